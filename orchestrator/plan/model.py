"""A model's architecture as numbers, and the tensors one rank holds of it, without building it.

`ModelSpec` reads an HF `config.json` (Llama, Qwen2/3, Qwen3-MoE, DeepSeek-V3 and GLM-5 style
MLA + MoE) or comes from a preset. `stage_tensors` lists, for one pipeline stage, every tensor
one rank holds under Megatron-core's sharding: column- and row-parallel linears and the
vocabulary split by TP; norms, routers and MLA's down projections replicated; routed experts
split by EP, and each expert by expert TP. Shapes follow Megatron-core's GPT layers, so the
numbers can be checked against its DDP buffers (tests/integration/test_plan_vs_megatron.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError


class Kind(StrEnum):
    """How a tensor sits in Megatron's DDP and optimizer."""

    PARAM = "param"  # bf16, in a DDP buffer, rebuilt from its fp32 main
    FP32 = "fp32"  # fp32-dtype param: its own DDP buffer, its "main" is itself (an extra)
    FROZEN = "frozen"  # requires_grad=False: in no DDP buffer, no optimizer (an extra)
    EXPERT_BIAS = "expert_bias"  # a router's fp32 module buffer (an extra)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor as one rank holds it. `expert`: in Megatron's expert-parallel buffers."""

    name: str
    numel: int
    kind: Kind = Kind.PARAM
    expert: bool = False


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, as the numbers that size it.

    `moe_layers[i]` says whether decoder layer i has a routed-expert MLP. MLA is on when
    `kv_lora_rank` is set; then `qk_head_dim` (= nope + rope) and `v_head_dim` apply.
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
    expert_bias: bool = False
    num_mtp_layers: int = 0  # DeepSeek-style multi-token prediction, on the last stage
    # tensors that the fp32 mains cannot rebuild, beyond expert_bias
    fp32_param_numel: int = 0  # fp32-dtype params added beside the architecture's
    frozen: tuple[str, ...] = ()  # names of params with requires_grad=False

    def __post_init__(self) -> None:
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (False,) * self.num_layers)
        problems = [
            f"{name} must be > 0, got {getattr(self, name)}"
            for name in ("hidden_size", "num_layers", "vocab_size", "num_attention_heads", "num_query_groups")
            if getattr(self, name) <= 0
        ]
        if len(self.moe_layers) != self.num_layers:
            problems.append(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if any(self.moe_layers) and (self.num_experts <= 0 or self.moe_ffn_hidden_size <= 0):
            problems.append("MoE layers need num_experts and moe_ffn_hidden_size")
        if problems:
            raise ConfigError([f"model {self.name}: {p}" for p in problems])

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

    def total_params(self) -> int:
        """Unique parameters of the model (no TP/PP copies), extras and MTP included."""
        whole = stage_tensors(self, range(self.num_layers), first=True, last=True, tp=1, ep=1, etp=1)
        return sum(t.numel for t in whole if t.kind is not Kind.EXPERT_BIAS)

    def active_params(self) -> int:
        """Parameters one token touches: routed experts counted `moe_router_topk` times, not all."""
        per_expert = 3 * self.hidden_size * self.moe_ffn_hidden_size
        moe = sum(self.moe_layers) + (self.num_mtp_layers if any(self.moe_layers) else 0)
        return self.total_params() - moe * per_expert * (self.num_experts - self.moe_router_topk)


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 x TP so each TP rank gets equal rows."""
    step = multiple * tp
    return math.ceil(vocab / step) * step


def _attention(m: ModelSpec, p: str, tp: int) -> Iterator[Tensor]:
    h = m.hidden_size
    yield Tensor(f"{p}input_layernorm.weight", h)
    a = f"{p}self_attention."
    if m.mla:
        heads = m.num_attention_heads // tp
        if m.q_lora_rank:
            yield Tensor(f"{a}linear_q_down_proj.weight", m.q_lora_rank * h)  # replicated over TP
            yield Tensor(f"{a}q_layernorm.weight", m.q_lora_rank)
            yield Tensor(f"{a}linear_q_up_proj.weight", heads * m.qk_head_dim * m.q_lora_rank)
        else:
            yield Tensor(f"{a}linear_q_proj.weight", heads * m.qk_head_dim * h)
        yield Tensor(f"{a}linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_rope_head_dim) * h)
        yield Tensor(f"{a}kv_layernorm.weight", m.kv_lora_rank)
        nope = m.qk_head_dim - m.qk_rope_head_dim
        yield Tensor(f"{a}linear_kv_up_proj.weight", heads * (nope + m.v_head_dim) * m.kv_lora_rank)
        yield Tensor(f"{a}linear_proj.weight", h * heads * m.v_head_dim)
        if m.index_n_heads:  # replicated over TP
            d = m.index_head_dim
            yield Tensor(f"{a}indexer.wq_b.weight", m.index_n_heads * d * (m.q_lora_rank or h))
            yield Tensor(f"{a}indexer.wk.weight", d * h)
            yield Tensor(f"{a}indexer.k_norm.weight_and_bias", 2 * d)
            yield Tensor(f"{a}indexer.weights_proj.weight", m.index_n_heads * h)
        return
    d, heads, groups = m.kv_channels, m.num_attention_heads // tp, m.num_query_groups // tp
    qkv = (heads + 2 * groups) * d
    yield Tensor(f"{a}linear_qkv.weight", qkv * h)
    if m.qkv_bias:
        yield Tensor(f"{a}linear_qkv.bias", qkv)
    if m.qk_norm:
        yield Tensor(f"{a}q_layernorm.weight", d)
        yield Tensor(f"{a}k_layernorm.weight", d)
    yield Tensor(f"{a}linear_proj.weight", h * heads * d)


def _gated_mlp(p: str, h: int, ffn: int, *, expert: bool = False) -> Iterator[Tensor]:
    yield Tensor(f"{p}linear_fc1.weight", 2 * ffn * h, expert=expert)
    yield Tensor(f"{p}linear_fc2.weight", h * ffn, expert=expert)


def _mlp(m: ModelSpec, p: str, moe: bool, tp: int, ep: int, etp: int) -> Iterator[Tensor]:
    h = m.hidden_size
    yield Tensor(f"{p}pre_mlp_layernorm.weight", h)
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


def stage_tensors(m: ModelSpec, layers: range, *, first: bool, last: bool, tp: int, ep: int, etp: int) -> list[Tensor]:
    """Every tensor one rank of a stage holding decoder `layers` has (all its TP/EP shards alike)."""
    h, vocab = m.hidden_size, padded_vocab(m.vocab_size, tp) // tp
    out: list[Tensor] = []
    if first:
        out.append(Tensor("embedding.word_embeddings.weight", vocab * h))
    for i in layers:
        out += _attention(m, f"decoder.layers.{i}.", tp)
        out += _mlp(m, f"decoder.layers.{i}.", m.moe_layers[i], tp, ep, etp)
    if last:
        out.append(Tensor("decoder.final_layernorm.weight", h))
        mtp_moe = any(m.moe_layers)
        for j in range(m.num_mtp_layers):
            p = f"mtp.layers.{j}."
            out += [Tensor(f"{p}enorm.weight", h), Tensor(f"{p}hnorm.weight", h)]
            out.append(Tensor(f"{p}eh_proj.weight", (h // tp) * 2 * h))
            out += _attention(m, f"{p}transformer_layer.", tp)
            out += _mlp(m, f"{p}transformer_layer.", mtp_moe, tp, ep, etp)
            out.append(Tensor(f"{p}final_layernorm.weight", h))
        # Off the first stage the last one holds its own copy of the embedding when it needs one:
        # to compute tied logits, or to embed MTP's inputs.
        if not first and (m.tie_embeddings or m.num_mtp_layers):
            out.append(Tensor("embedding.word_embeddings.weight (last-stage copy)", vocab * h))
        if not m.tie_embeddings:
            out.append(Tensor("output_layer.weight", vocab * h))
    if m.fp32_param_numel and last:
        out.append(Tensor("fp32_params", m.fp32_param_numel, Kind.FP32))
    if m.frozen:
        frozen = set(m.frozen)
        out = [Tensor(t.name, t.numel, Kind.FROZEN, t.expert) if t.name in frozen else t for t in out]
    return out


def from_hf_config(path: Path) -> ModelSpec:
    """Read an HF `config.json`. Raises ConfigError naming the file and what is wrong."""
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{path}: not a readable JSON config ({exc})"]) from None
    if not isinstance(cfg, dict):
        raise ConfigError([f"{path}: not a JSON object"])
    cfg = cfg.get("text_config", cfg)
    try:
        return _spec_from_dict(cfg, name=str(cfg.get("_name_or_path") or path.parent.name or path.name))
    except KeyError as exc:
        raise ConfigError([f"{path}: missing {exc.args[0]!r}"]) from None


def _spec_from_dict(c: dict[str, Any], *, name: str) -> ModelSpec:
    layers, hidden = int(c["num_hidden_layers"]), int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    experts = int(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0)
    moe: tuple[bool, ...] = (False,) * layers
    if experts:
        dense_first = int(c.get("first_k_dense_replace", 0))
        step = int(c.get("decoder_sparse_step", c.get("moe_layer_freq", 1)) or 1)
        only_dense = set(c.get("mlp_only_layers") or [])
        moe = tuple(i >= dense_first and (i + 1) % step == 0 and i not in only_dense for i in range(layers))
    moe_ffn = int(c.get("moe_intermediate_size") or 0)
    shared = int(c.get("n_shared_experts") or 0) * moe_ffn or int(c.get("shared_expert_intermediate_size") or 0)
    arch = " ".join(c.get("architectures") or [c.get("model_type", "")])
    qk_nope, qk_rope = int(c.get("qk_nope_head_dim") or 0), int(c.get("qk_rope_head_dim") or 0)
    return ModelSpec(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=int(c["vocab_size"]),
        num_attention_heads=heads,
        num_query_groups=int(c.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(c.get("intermediate_size") or 4 * hidden),
        head_dim=int(c.get("head_dim") or 0) if "kv_lora_rank" not in c else 0,
        qk_norm="Qwen3" in arch or bool(c.get("use_qk_norm")),
        qkv_bias=bool(c.get("attention_bias", "Qwen2" in arch)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        q_lora_rank=int(c.get("q_lora_rank") or 0),
        kv_lora_rank=int(c.get("kv_lora_rank") or 0),
        qk_head_dim=qk_nope + qk_rope,
        qk_rope_head_dim=qk_rope,
        v_head_dim=int(c.get("v_head_dim") or 0),
        index_n_heads=int(c.get("index_n_heads") or 0),
        index_head_dim=int(c.get("index_head_dim") or 0),
        moe_layers=moe,
        num_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        moe_router_topk=int(c.get("num_experts_per_tok") or 1),
        shared_expert_ffn=shared,
        expert_bias=c.get("topk_method") == "noaux_tc" or "n_group" in c,
        num_mtp_layers=int(c.get("num_nextn_predict_layers") or 0),
    )
