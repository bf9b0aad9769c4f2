"""A model's architecture as numbers, and the tensors one rank holds of it, without building it.

`ModelSpec` comes from an HF config, read by orchestrator.models' one reader (`from_hf_config`,
`from_architecture`), or from a preset. `stage_tensors` lists, for one pipeline stage, every
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
from orchestrator.models import Architecture, read_config


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


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, as the numbers that size it.

    `moe_layers[i]` says whether decoder layer i has a routed-expert MLP. MLA is on when
    `kv_lora_rank` is set; then `qk_head_dim` (= nope + rope) and `v_head_dim` apply.
    `not_counted`: the parts of the source model these numbers leave out (a vision tower);
    `assumed`: what its config did not say and the reader assumed.
    """

    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    qk_norm: bool = False
    qkv_bias: bool = False
    out_bias: bool = False  # a bias on the attention's output projection (replicated over TP)
    # Gemma's norms after attention and after the MLP: counted as HF builds them (megatron-core's
    # TransformerLayer has no slot for them; a Gemma layer spec adds its own).
    sandwich_norms: bool = False
    tie_embeddings: bool = False
    # MLA (DeepSeek-V3 / GLM-5)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    index_n_heads: int = 0  # DeepSeek sparse attention's indexer (0: none)
    index_head_dim: int = 0
    # MoE
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 1
    shared_expert_ffn: int = 0  # all shared experts together
    shared_expert_gate: bool = False
    expert_bias: bool = False
    num_mtp_layers: int = 0  # DeepSeek-style multi-token prediction, on the last stage
    # tensors that the fp32 mains cannot rebuild, beyond expert_bias
    fp32_param_numel: int = 0  # fp32-dtype params added beside the architecture's
    frozen: tuple[str, ...] = ()  # names of params with requires_grad=False
    not_counted: tuple[str, ...] = ()
    assumed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (False,) * self.num_layers)
        problems = self.problems()
        if problems:
            raise ConfigError([f"model {self.name}: {p}" for p in problems])

    def problems(self) -> list[str]:
        ints = {k: v for k, v in vars(self).items() if isinstance(v, int) and not isinstance(v, bool)}
        out = [f"{k} must be >= 0, got {v}" for k, v in ints.items() if v < 0]
        required = ("hidden_size", "num_layers", "vocab_size", "num_attention_heads", "num_query_groups")
        out += [f"{k} must be > 0, got {ints[k]}" for k in required if ints[k] == 0]
        if out:
            return out
        if not self.mla and self.num_attention_heads % self.num_query_groups:
            out.append(f"{self.num_attention_heads} heads do not split into {self.num_query_groups} query groups")
        if len(self.moe_layers) != self.num_layers:
            out.append(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if any(self.moe_layers) and (self.num_experts <= 0 or self.moe_ffn_hidden_size <= 0):
            out.append("MoE layers need num_experts and moe_ffn_hidden_size")
        if not all(self.moe_layers) and self.ffn_hidden_size <= 0:
            out.append("dense layers need ffn_hidden_size")
        return out

    @classmethod
    def from_architecture(cls, a: Architecture, name: str | None = None) -> ModelSpec:
        """The planner's view of an HF architecture (orchestrator.models.read_config)."""
        return cls(
            name=name or a.name,
            hidden_size=a.hidden_size,
            num_layers=a.num_layers,
            vocab_size=a.vocab_size,
            num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_kv_heads,
            ffn_hidden_size=a.ffn_hidden_size,
            head_dim=a.head_dim,
            qk_norm=a.qk_norm,
            qkv_bias=a.qkv_bias,
            out_bias=a.out_bias,
            sandwich_norms=a.sandwich_norms,
            tie_embeddings=a.tie_embeddings,
            q_lora_rank=a.q_lora_rank,
            kv_lora_rank=a.kv_lora_rank,
            qk_head_dim=a.qk_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            index_n_heads=a.index_n_heads,
            index_head_dim=a.index_head_dim,
            moe_layers=a.moe_layers,
            num_experts=a.num_experts,
            moe_ffn_hidden_size=a.moe_ffn_hidden_size,
            moe_router_topk=a.moe_router_topk or 1,
            shared_expert_ffn=a.shared_expert_ffn,
            shared_expert_gate=a.shared_expert_gate,
            expert_bias=a.expert_bias,
            num_mtp_layers=a.num_mtp_layers,
            not_counted=a.not_counted,
            assumed=a.assumed,
        )

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_bytes_per_token(self, gpus: int = 1) -> int:
        """bf16 KV cache bytes one token takes on one of `gpus` engine GPUs (tensor parallel), over
        every decoder layer: K and V of the KV heads that GPU holds (heads fewer than the GPUs are
        replicated), or MLA's latent and rope key, which every GPU holds whole."""
        if self.mla:
            return 2 * self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        heads = math.ceil(self.num_query_groups / max(gpus, 1))
        return 2 * 2 * self.num_layers * heads * self.kv_channels

    def total_params(self, tp: int = 1) -> int:
        """Unique parameters of Megatron's model (no TP/PP copies), extras and MTP included, with
        the vocabulary padded as Megatron pads it at tensor-parallel size `tp`."""
        counted = sum(t.numel for t in self._whole() if t.kind is not Kind.EXPERT_BIAS)
        return counted + self._vocab_padding(tp)

    def total_bytes(self, tp: int = 1) -> int:
        """Bytes of those parameters in their dtypes (`Tensor.nbytes`), the routers' expert_bias
        buffers included: the model as a checkpoint holds it, each tensor once."""
        return sum(t.nbytes for t in self._whole()) + 2 * self._vocab_padding(tp)

    def _whole(self) -> list[Tensor]:
        return stage_tensors(self, range(self.num_layers), first=True, last=True, tp=1, ep=1, etp=1)

    def _vocab_padding(self, tp: int) -> int:
        """Parameters the vocabulary's padding at TP `tp` adds beyond its padding at TP 1 (bf16)."""
        return (padded_vocab(self.vocab_size, tp) - padded_vocab(self.vocab_size, 1)) * self.vocab_row_params

    def mtp_params(self) -> int:
        """Parameters of the MTP layers (their embedding is the model's)."""
        whole = stage_tensors(self, range(0), first=False, last=True, tp=1, ep=1, etp=1)
        return sum(t.numel for t in whole if t.name.startswith("mtp.") and t.kind is not Kind.EXPERT_BIAS)

    def hf_params(self) -> int:
        """What the HF checkpoint holds of it: no vocabulary padding, no MTP layers (HF's models
        do not build them), and none of `not_counted`."""
        padding = (padded_vocab(self.vocab_size, 1) - self.vocab_size) * self.vocab_row_params
        return self.total_params() - self.mtp_params() - padding

    @property
    def vocab_row_params(self) -> int:
        """Parameters one vocabulary entry adds: its embedding row, and its output row unless tied."""
        return self.hidden_size * (1 if self.tie_embeddings else 2)

    def active_params(self, tp: int = 1) -> int:
        """Parameters one token touches: routed experts counted `moe_router_topk` times, not all."""
        per_expert = 3 * self.hidden_size * self.moe_ffn_hidden_size
        moe = sum(self.moe_layers) + (self.num_mtp_layers if any(self.moe_layers) else 0)
        return self.total_params(tp) - moe * per_expert * (self.num_experts - self.moe_router_topk)


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 x TP so each TP rank gets equal rows."""
    step = multiple * tp
    return math.ceil(vocab / step) * step


def _attention(m: ModelSpec, p: str, tp: int, spec: LayerSpec) -> Iterator[Tensor]:
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
        if m.qk_norm:
            yield Tensor(f"{a}q_layernorm.weight", d)
            yield Tensor(f"{a}k_layernorm.weight", d)
        yield Tensor(f"{a}linear_proj.weight", h * heads * d)
    if m.out_bias:
        yield Tensor(f"{a}linear_proj.bias", h)  # a row-parallel bias: whole on every rank
    if m.sandwich_norms:
        yield Tensor(f"{p}post_attention_layernorm.weight", h)


def _mla(m: ModelSpec, a: str, tp: int, spec: LayerSpec) -> Iterator[Tensor]:
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
    nope = m.qk_head_dim - m.qk_rope_head_dim
    yield Tensor(f"{a}linear_kv_up_proj.weight", heads * (nope + m.v_head_dim) * m.kv_lora_rank)
    yield Tensor(f"{a}linear_proj.weight", h * heads * m.v_head_dim)
    if m.index_n_heads:  # replicated over TP (the TE spec is the only one that builds it)
        d = m.index_head_dim
        yield Tensor(f"{a}indexer.wq_b.weight", m.index_n_heads * d * (m.q_lora_rank or h))
        yield Tensor(f"{a}indexer.wk.weight", d * h)
        yield Tensor(f"{a}indexer.k_norm.weight_and_bias", 2 * d)
        yield Tensor(f"{a}indexer.weights_proj.weight", m.index_n_heads * h)


def _gated_mlp(p: str, h: int, ffn: int, *, expert: bool = False) -> Iterator[Tensor]:
    yield Tensor(f"{p}linear_fc1.weight", 2 * ffn * h, expert=expert)
    yield Tensor(f"{p}linear_fc2.weight", h * ffn, expert=expert)


def _mlp(m: ModelSpec, p: str, moe: bool, tp: int, ep: int, etp: int) -> Iterator[Tensor]:
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
    if m.shared_expert_ffn:
        yield from _gated_mlp(f"{p}mlp.shared_experts.", h, m.shared_expert_ffn // tp)
        if m.shared_expert_gate:
            yield Tensor(f"{p}mlp.shared_experts.gate_weight", h)  # replicated over TP


def stage_tensors(
    m: ModelSpec,
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
    if first:
        out.append(Tensor("embedding.word_embeddings.weight", vocab * h))
    for i in layers:
        out += _attention(m, f"decoder.layers.{i}.", tp, spec)
        out += _mlp(m, f"decoder.layers.{i}.", m.moe_layers[i], tp, ep, etp)
    if last:
        out.append(Tensor("decoder.final_layernorm.weight", h))
        mtp_moe = any(m.moe_layers)
        for j in range(m.num_mtp_layers):
            p = f"mtp.layers.{j}."
            out += [Tensor(f"{p}enorm.weight", h), Tensor(f"{p}hnorm.weight", h)]
            out.append(Tensor(f"{p}eh_proj.weight", (h // tp) * 2 * h))
            out += _attention(m, f"{p}transformer_layer.", tp, spec)
            out += _mlp(m, f"{p}transformer_layer.", mtp_moe, tp, ep, etp)
            out.append(Tensor(f"{p}final_layernorm.weight", h))
        # Off the first stage the last one holds its own copy of the embedding when it needs one:
        # to compute tied logits, or to embed MTP's inputs.
        if not first and (m.tie_embeddings or m.num_mtp_layers):
            out.append(Tensor("embedding.word_embeddings.weight (last-stage copy)", vocab * h, copy=True))
        if not m.tie_embeddings:
            out.append(Tensor("output_layer.weight", vocab * h))
    if m.fp32_param_numel and last:
        out.append(Tensor("fp32_params", m.fp32_param_numel, Kind.FP32))
    if m.frozen:
        frozen = set(m.frozen)
        out = [replace(t, kind=Kind.FROZEN) if t.name in frozen else t for t in out]
    return out


def from_hf_config(path: Path, name: str | None = None) -> ModelSpec:
    """Read an HF `config.json`. Raises ConfigError naming the file and what is wrong."""
    try:
        mapping = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{path}: not a readable JSON config ({exc})"]) from None
    return from_config(mapping, source=str(path), name=name)


def from_config(mapping: Any, *, source: str, name: str | None = None) -> ModelSpec:
    """An HF config's mapping (a config.json's object, or `PretrainedConfig.to_dict()`)."""
    return ModelSpec.from_architecture(read_config(mapping, source=source), name)
