"""The tensors one rank holds of a model's shape, and the counts made of them, without building it.

The `ModelShape` comes from an HF config, read by orchestrator.models' one reader
(`from_hf_config`, `from_config`), or from a preset. `stage_tensors` lists, for one pipeline stage, every
tensor one rank holds under Megatron-core's sharding: column- and row-parallel linears and the
vocabulary split by TP; norms and routers replicated; routed experts split by EP, and each
expert by expert TP. MLA's down projections follow the layer spec (`LayerSpec`). Shapes follow
Megatron-core's GPT layers, so the numbers can be checked against its DDP buffers
(tests/integration/test_plan_vs_megatron.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.models import ModelShape, read_config


class LayerSpec(StrEnum):
    """Megatron-core's layer spec, where it shards differently.

    Both build MLA with its q and kv down projections; the TE spec
    (`get_gpt_layer_with_transformer_engine_spec`) makes them `backend.linear()`, replicated
    over TP, and the local spec (`get_gpt_layer_local_spec`) column-parallel, split over TP.
    DSA's indexer is built only by the TE spec (`get_dsa_module_spec_for_backend`: its linears
    are `parallel_mode="duplicated"`, replicated); the local backend has no such linear.
    """

    TE = "te"
    LOCAL = "local"


class Kind(StrEnum):
    """How a tensor sits in Megatron's DDP and optimizer."""

    PARAM = "param"  # bf16, in a DDP buffer, rebuilt from its fp32 main
    FP32 = "fp32"  # fp32-dtype param: its own DDP buffer, its "main" is itself (an extra)
    FROZEN = "frozen"  # requires_grad=False: in no DDP buffer, no optimizer (an extra)
    EXPERT_BIAS = "expert_bias"  # a router's fp32 module buffer (an extra)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor as one rank holds it. `expert`: in Megatron's expert-parallel buffers. `copy`: a
    stage's copy of a tensor another stage holds (the word embeddings on the last stage): held
    and trained here, saved from there (Megatron gives it a nonzero replica id)."""

    name: str
    numel: int
    kind: Kind = Kind.PARAM
    expert: bool = False
    copy: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes in its own dtype: bf16, but fp32 for fp32 params and the routers' expert_bias."""
        return self.numel * (4 if self.kind in (Kind.FP32, Kind.EXPERT_BIAS) else 2)


def kv_bytes_per_token(m: ModelShape, gpus: int = 1) -> int:
    """bf16 KV cache bytes one token takes on one of `gpus` engine GPUs (tensor parallel), over
    every decoder layer: K and V of the KV heads that GPU holds (heads fewer than the GPUs are
    replicated), or MLA's latent and rope key, which every GPU holds whole, with a DSA indexer's
    keys where the model has one (transformers' `StaticIndexedLayer` and the transformers engine's
    slab keep them beside the latent, one vector a token and layer)."""
    if m.mla:
        return 2 * m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim + m.dsa_index_head_dim)
    heads = math.ceil(m.num_query_groups / max(gpus, 1))
    return 2 * 2 * m.num_layers * heads * m.kv_channels


def total_params(m: ModelShape, tp: int = 1) -> int:
    """Unique parameters of Megatron's model (no TP/PP copies), extras and MTP included, with
    the vocabulary padded as Megatron pads it at tensor-parallel size `tp`."""
    counted = sum(t.numel for t in _whole(m) if t.kind is not Kind.EXPERT_BIAS)
    return counted + _vocab_padding(m, tp)


def total_bytes(m: ModelShape, tp: int = 1) -> int:
    """Bytes of those parameters in their dtypes (`Tensor.nbytes`), the routers' expert_bias
    buffers included: the model as a checkpoint holds it, each tensor once."""
    return sum(t.nbytes for t in _whole(m)) + 2 * _vocab_padding(m, tp)


def _whole(m: ModelShape) -> list[Tensor]:
    return stage_tensors(m, range(m.num_layers), first=True, last=True, tp=1, ep=1, etp=1)


def _vocab_padding(m: ModelShape, tp: int) -> int:
    """Parameters the vocabulary's padding at TP `tp` adds beyond its padding at TP 1 (bf16)."""
    return (padded_vocab(m.vocab_size, tp) - padded_vocab(m.vocab_size, 1)) * m.vocab_row_params


def mtp_params(m: ModelShape) -> int:
    """Parameters of the MTP layers (their embedding is the model's)."""
    whole = stage_tensors(m, range(0), first=False, last=True, tp=1, ep=1, etp=1)
    return sum(t.numel for t in whole if t.name.startswith("mtp.") and t.kind is not Kind.EXPERT_BIAS)


def hf_params(m: ModelShape) -> int:
    """What the HF checkpoint holds of it: no vocabulary padding, no MTP layers (HF's models
    do not build them), and none of `not_counted`."""
    padding = (padded_vocab(m.vocab_size, 1) - m.vocab_size) * m.vocab_row_params
    return total_params(m) - mtp_params(m) - padding


def active_params(m: ModelShape, tp: int = 1) -> int:
    """Parameters one token touches: routed experts counted `moe_router_topk` times, not all."""
    per_expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
    moe = len(m.moe_layers) + (m.mtp_num_layers if m.moe_layers else 0)
    return total_params(m, tp) - moe * per_expert * (m.num_experts - m.moe_router_topk)


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 x TP so each TP rank gets equal rows."""
    step = multiple * tp
    return math.ceil(vocab / step) * step


def _attention(m: ModelShape, p: str, tp: int, spec: LayerSpec) -> Iterator[Tensor]:
    h = m.hidden_size
    yield Tensor(f"{p}input_layernorm.weight", h)
    a = f"{p}self_attention."
    if m.mla:
        yield from _mla(m, a, tp, spec)
    else:
        d, heads, groups = m.kv_channels, m.num_attention_heads // tp, m.num_query_groups // tp
        qkv = (heads + 2 * groups) * d
        yield Tensor(f"{a}linear_qkv.weight", qkv * h)
        if m.qkv_bias:
            yield Tensor(f"{a}linear_qkv.bias", qkv)
        if m.qk_layernorm:
            yield Tensor(f"{a}q_layernorm.weight", d)
            yield Tensor(f"{a}k_layernorm.weight", d)
        yield Tensor(f"{a}linear_proj.weight", h * heads * d)
    if m.out_bias:
        yield Tensor(f"{a}linear_proj.bias", h)  # a row-parallel bias: whole on every rank
    if m.sandwich_norms:
        yield Tensor(f"{p}post_attention_layernorm.weight", h)


def _mla(m: ModelShape, a: str, tp: int, spec: LayerSpec) -> Iterator[Tensor]:
    h, heads = m.hidden_size, m.num_attention_heads // tp
    down = tp if spec is LayerSpec.LOCAL else 1  # the down projections: split, or replicated
    if m.q_lora_rank:
        yield Tensor(f"{a}linear_q_down_proj.weight", m.q_lora_rank // down * h)
        yield Tensor(f"{a}q_layernorm.weight", m.q_lora_rank)
        yield Tensor(f"{a}linear_q_up_proj.weight", heads * m.qk_head_dim * m.q_lora_rank)
    else:
        yield Tensor(f"{a}linear_q_proj.weight", heads * m.qk_head_dim * h)
    yield Tensor(f"{a}linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_rope_head_dim) // down * h)
    yield Tensor(f"{a}kv_layernorm.weight", m.kv_lora_rank)
    nope = m.qk_nope_head_dim
    yield Tensor(f"{a}linear_kv_up_proj.weight", heads * (nope + m.v_head_dim) * m.kv_lora_rank)
    yield Tensor(f"{a}linear_proj.weight", h * heads * m.v_head_dim)
    if m.dsa_index_n_heads:  # replicated over TP (the TE spec is the only one that builds it)
        d = m.dsa_index_head_dim
        yield Tensor(f"{a}indexer.wq_b.weight", m.dsa_index_n_heads * d * (m.q_lora_rank or h))
        yield Tensor(f"{a}indexer.wk.weight", d * h)
        yield Tensor(f"{a}indexer.k_norm.weight_and_bias", 2 * d)
        yield Tensor(f"{a}indexer.weights_proj.weight", m.dsa_index_n_heads * h)


def _gated_mlp(p: str, h: int, ffn: int, *, expert: bool = False) -> Iterator[Tensor]:
    yield Tensor(f"{p}linear_fc1.weight", 2 * ffn * h, expert=expert)
    yield Tensor(f"{p}linear_fc2.weight", h * ffn, expert=expert)


def _mlp(m: ModelShape, p: str, moe: bool, tp: int, ep: int, etp: int) -> Iterator[Tensor]:
    h = m.hidden_size
    yield Tensor(f"{p}pre_mlp_layernorm.weight", h)
    if m.sandwich_norms:
        yield Tensor(f"{p}post_mlp_layernorm.weight", h)
    if not moe:
        yield from _gated_mlp(f"{p}mlp.", h, m.ffn_hidden_size // tp)
        return
    yield Tensor(f"{p}mlp.router.weight", m.num_experts * h)  # replicated over TP and EP
    if m.expert_bias:
        yield Tensor(f"{p}mlp.router.expert_bias", m.num_experts, Kind.EXPERT_BIAS)
    for e in range(m.num_experts // ep):
        yield from _gated_mlp(f"{p}mlp.experts.local_experts.{e}.", h, m.moe_ffn_hidden_size // etp, expert=True)
    if m.moe_shared_ffn_hidden_size:
        yield from _gated_mlp(f"{p}mlp.shared_experts.", h, m.moe_shared_ffn_hidden_size // tp)
        if m.shared_expert_gate:
            yield Tensor(f"{p}mlp.shared_experts.gate_weight", h)  # replicated over TP


def stage_tensors(
    m: ModelShape,
    layers: range,
    *,
    first: bool,
    last: bool,
    tp: int,
    ep: int,
    etp: int,
    spec: LayerSpec = LayerSpec.TE,
) -> list[Tensor]:
    """Every tensor one rank of a stage holding decoder `layers` has (all its TP/EP shards alike)."""
    h, vocab = m.hidden_size, padded_vocab(m.vocab_size, tp) // tp
    out: list[Tensor] = []
    moe_layers = set(m.moe_layers)
    if first:
        out.append(Tensor("embedding.word_embeddings.weight", vocab * h))
    for i in layers:
        out += _attention(m, f"decoder.layers.{i}.", tp, spec)
        out += _mlp(m, f"decoder.layers.{i}.", i in moe_layers, tp, ep, etp)
    if last:
        out.append(Tensor("decoder.final_layernorm.weight", h))
        mtp_moe = bool(m.moe_layers)
        for j in range(m.mtp_num_layers):
            p = f"mtp.layers.{j}."
            out += [Tensor(f"{p}enorm.weight", h), Tensor(f"{p}hnorm.weight", h)]
            out.append(Tensor(f"{p}eh_proj.weight", (h // tp) * 2 * h))
            out += _attention(m, f"{p}transformer_layer.", tp, spec)
            out += _mlp(m, f"{p}transformer_layer.", mtp_moe, tp, ep, etp)
            out.append(Tensor(f"{p}final_layernorm.weight", h))
        # Off the first stage the last one holds its own copy of the embedding when it needs one:
        # to compute tied logits, or to embed MTP's inputs.
        if not first and (m.tie_embeddings or m.mtp_num_layers):
            out.append(Tensor("embedding.word_embeddings.weight (last-stage copy)", vocab * h, copy=True))
        if not m.tie_embeddings:
            out.append(Tensor("output_layer.weight", vocab * h))
    if m.fp32_param_numel and last:
        out.append(Tensor("fp32_params", m.fp32_param_numel, Kind.FP32))
    if m.frozen:
        frozen = set(m.frozen)
        out = [replace(t, kind=Kind.FROZEN) if t.name in frozen else t for t in out]
    return out


def from_hf_config(path: Path, name: str | None = None) -> ModelShape:
    """Read an HF `config.json`. Raises ConfigError naming the file and what is wrong."""
    try:
        mapping = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{path}: not a readable JSON config ({exc})"]) from None
    return from_config(mapping, source=str(path), name=name)


def from_config(mapping: Any, *, source: str, name: str | None = None) -> ModelShape:
    """An HF config's mapping (a config.json's object, or `PretrainedConfig.to_dict()`), named
    `name` when given."""
    shape = read_config(mapping, source=source)
    return replace(shape, name=name) if name else shape
