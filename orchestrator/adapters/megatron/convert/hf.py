"""Whole Megatron tensors → Hugging Face tensors, one Megatron tensor at a time.

A whole tensor is one as at tensor-, pipeline- and expert-parallel size 1: global layer and
expert indices, every shard in place (`gather.hf_buckets` makes them so). A Megatron name
(`decoder.layers.0.self_attention.linear_qkv.weight`) becomes the HF checkpoint names an engine
loads (`model.layers.0.self_attn.q_proj.weight`, `k_proj`, `v_proj`). The dense mapping is
Llama's, checked against transformers' logits (docs/conversion.md); the families add:

- Qwen3: `self_attention.{q,k}_layernorm` → `self_attn.{q,k}_norm` (per-head RMSNorm);
- Qwen3-MoE: `mlp.router` → `mlp.gate`, `mlp.experts.local_experts.<e>.linear_fc1/2` →
  `mlp.experts.<e>.{gate,up,down}_proj` (the checkpoint layout; transformers fuses the experts
  itself when it loads them);
- Mixtral: the same tensors → `block_sparse_moe.{gate,experts.<e>.w1,w3,w2}` (`mixtral`);
- DeepSeek-V3: multi-latent attention and YaRN (`mla`), DeepSeek-style MoE layers (`routed`);
- GLM-4.5: q/k/v biases, a partial rotary, an optional q/k norm (`glm`), `routed`'s MoE layers;
- GLM-5: DeepSeek-V3's with a DSA indexer (`dsa`) and MTP layers (`mtp`).

A GroupedMLP's `mlp.experts.weight1/2` are read as SequentialMLP's per-expert tensors (`grouped`).
Tied embeddings (`spec.tie_embeddings`): HF's checkpoint holds `embed_tokens` alone, so Megatron's
`output_layer.weight` (a PP > 1 last stage's copy of the embedding) becomes no HF tensor. The
transformers config of each family is `configs.hf_config`.

What a family has no counterpart for is refused by name rather than dropped, since an engine
missing it would serve a different policy.

    spec = as_spec(cfg)                    # or shape_from_megatron(config, gpt, "qwen3")
    hf = [pair for name, tensor in whole for pair in to_hf(name, tensor, spec)]
    missing = set(hf_names(spec)) - {name for name, _ in hf}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from orchestrator.adapters.megatron.convert import dsa, glm, mixtral, mla, routed
from orchestrator.adapters.megatron.convert import mtp as mtp_layers
from orchestrator.adapters.megatron.convert.configs import (
    ATTN_IMPLEMENTATION,
    Shape,
    as_spec,
    hf_config,
    hf_llama_config,
)
from orchestrator.adapters.megatron.convert.grouped import TE_GROUPED, per_expert, per_expert_names, read_as
from orchestrator.adapters.megatron.convert.rules import ANY as _ANY
from orchestrator.adapters.megatron.convert.rules import DENSE as _DENSE
from orchestrator.adapters.megatron.convert.rules import EXPERT as _EXPERT
from orchestrator.adapters.megatron.convert.rules import LAYER as _LAYER
from orchestrator.adapters.megatron.convert.rules import MOE as _MOE
from orchestrator.adapters.megatron.convert.rules import MTP as _MTP
from orchestrator.adapters.megatron.convert.rules import Rule, Split, compile_rules
from orchestrator.adapters.megatron.convert.rules import gate_up as _split_fc1
from orchestrator.adapters.megatron.convert.rules import same as _same
from orchestrator.adapters.megatron.convert.rules import split_qkv as _split_qkv
from orchestrator.adapters.megatron.convert.spec import MEGATRON_LAYERNORM_EPS, Family
from orchestrator.models import ModelShape

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MEGATRON_LAYERNORM_EPS",
    "convert",
    "hf_config",
    "hf_llama_config",
    "hf_names",
    "hf_shape",
    "hf_targets",
    "to_hf",
]

# ---- per-tensor mapping ---------------------------------------------------------------------


# (Megatron name pattern, HF names with {i} for the layer and {e} for the expert, how to split,
# the layer kind, the families that have it); Mixtral's MoE layer is in `mixtral`. The TE-spec
# names (norm fused into the next linear as `layer_norm_weight`) map to the same HF norms.
_ALL = frozenset(Family)
_QK = frozenset({Family.QWEN3, Family.QWEN3_MOE})
_RULES: tuple[Rule, ...] = compile_rules(
    (
        *mixtral.RULES,
        (r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), _same, _ANY, _ALL),
        (_LAYER + r"input_layernorm\.weight", ("model.layers.{i}.input_layernorm.weight",), _same, _ANY, _ALL),
        (
            _LAYER + r"self_attention\.linear_qkv\.layer_norm_weight",
            ("model.layers.{i}.input_layernorm.weight",),
            _same,
            _ANY,
            _ALL,
        ),
        (
            _LAYER + r"self_attention\.linear_qkv\.weight",
            tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
            _split_qkv,
            _ANY,
            _ALL,
        ),
        (
            _LAYER + r"self_attention\.q_layernorm\.weight",
            ("model.layers.{i}.self_attn.q_norm.weight",),
            _same,
            _ANY,
            _QK,
        ),
        (
            _LAYER + r"self_attention\.k_layernorm\.weight",
            ("model.layers.{i}.self_attn.k_norm.weight",),
            _same,
            _ANY,
            _QK,
        ),
        (
            _LAYER + r"self_attention\.linear_proj\.weight",
            ("model.layers.{i}.self_attn.o_proj.weight",),
            _same,
            _ANY,
            _ALL,
        ),
        (
            _LAYER + r"pre_mlp_layernorm\.weight",
            ("model.layers.{i}.post_attention_layernorm.weight",),
            _same,
            _ANY,
            _ALL,
        ),
        (
            _LAYER + r"mlp\.linear_fc1\.layer_norm_weight",
            ("model.layers.{i}.post_attention_layernorm.weight",),
            _same,
            _DENSE,
            _ALL,
        ),
        (
            _LAYER + r"mlp\.linear_fc1\.weight",
            ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
            _split_fc1,
            _DENSE,
            _ALL,
        ),
        (_LAYER + r"mlp\.linear_fc2\.weight", ("model.layers.{i}.mlp.down_proj.weight",), _same, _DENSE, _ALL),
        (_LAYER + r"mlp\.router\.weight", ("model.layers.{i}.mlp.gate.weight",), _same, _MOE, {Family.QWEN3_MOE}),
        (
            _EXPERT + r"linear_fc1\.weight",
            ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
            _split_fc1,
            _MOE,
            {Family.QWEN3_MOE},
        ),
        (
            _EXPERT + r"linear_fc2\.weight",
            ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
            _same,
            _MOE,
            {Family.QWEN3_MOE},
        ),
        (r"decoder\.final_layernorm\.weight", ("model.norm.weight",), _same, _ANY, _ALL),
        (r"output_layer\.weight", ("lm_head.weight",), _same, _ANY, _ALL),
    )
) + (mla.RULES + routed.RULES + glm.RULES + dsa.RULES + mtp_layers.RULES)

# Known Megatron tensors a family has no counterpart for, and why.
_REFUSED: tuple[tuple[re.Pattern[str], frozenset[Family], str], ...] = (
    (
        re.compile(r"\.mlp\.(experts|router)\.|expert_bias$"),
        frozenset({Family.LLAMA, Family.QWEN3}),
        "MoE tensors have no counterpart in a dense model",
    ),
    (
        re.compile(r"expert_bias$"),
        frozenset({Family.MIXTRAL}),
        "Mixtral's router has no expert bias (it routes by softmax alone)",
    ),
    (
        TE_GROUPED,
        _ALL,
        "Transformer Engine's TEGroupedMLP layout is not converted (build the experts with the local "
        "spec's GroupedMLP or SequentialMLP)",
    ),
    (
        re.compile(r"expert_bias$"),
        frozenset({Family.QWEN3_MOE}),
        "Qwen3-MoE's router has no expert bias (it routes by softmax alone)",
    ),
    (re.compile(r"(^|\.)fp32_output_scale$"), _ALL, "fp32_output_scale is a test-only param with no HF counterpart"),
)


def _expected_shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = spec.hidden_size, spec.kv_channels
    return {
        "embed_tokens": (spec.vocab_size, hidden),
        "lm_head": (spec.vocab_size, hidden),
        "layernorm": (hidden,),
        "norm": (hidden,),
        "q_norm": (head_dim,),
        "k_norm": (head_dim,),
        "q_proj": (spec.num_attention_heads * head_dim, hidden),
        "k_proj": (spec.num_query_groups * head_dim, hidden),
        "v_proj": (spec.num_query_groups * head_dim, hidden),
        "o_proj": (hidden, spec.num_attention_heads * head_dim),
        "gate_proj": (spec.ffn_hidden_size, hidden),
        "up_proj": (spec.ffn_hidden_size, hidden),
        "down_proj": (hidden, spec.ffn_hidden_size),
        "gate": (spec.num_experts, hidden),
        "expert.gate_proj": (spec.moe_ffn_hidden_size, hidden),
        "expert.up_proj": (spec.moe_ffn_hidden_size, hidden),
        "expert.down_proj": (hidden, spec.moe_ffn_hidden_size),
        **mixtral.expert_shapes(spec),
        **routed.shapes(spec),
        **mla.shapes(spec),  # MLA's q_proj and o_proj replace GQA's
        **dsa.shapes(spec),
        **mtp_layers.shapes(spec),
    }


def hf_shape(hf_name: str, cfg: Shape) -> tuple[int, ...]:
    """The shape the HF model built from `hf_config(cfg)` gives the checkpoint name `hf_name`."""
    if hf_name.endswith(".bias"):  # a linear's: one per output row
        return hf_shape(hf_name.removesuffix(".bias") + ".weight", cfg)[:1]
    shapes = _expected_shapes(as_spec(cfg))
    module = hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
    if ".experts." in hf_name:
        module = f"expert.{module}"
    elif ".shared_experts." in hf_name:
        module = f"shared.{module}"
    elif ".indexer." in hf_name:
        module = f"indexer.{module}"
    elif module.endswith("layernorm") and module not in shapes:
        module = "layernorm"
    return shapes[module]


def _expected_source_shape(targets: list[str], spec: ModelShape) -> tuple[int, ...]:
    """The Megatron tensor is its HF parts stacked along the rows (or one of them as is)."""
    shapes = [hf_shape(t, spec) for t in targets]
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _kind_problem(match: re.Match[str], kind: str, spec: ModelShape) -> str | None:
    layer = match.groupdict().get("i")
    if layer is None:
        return None
    if int(layer) >= spec.num_layers + spec.mtp_num_layers:
        return f"layer {layer} is beyond num_layers={spec.num_layers} and {spec.mtp_num_layers} MTP layer(s)"
    is_mtp = int(layer) >= spec.num_layers
    if kind == _MTP and not is_mtp:
        return f"layer {layer} is a decoder layer, not an MTP layer"
    # An MTP layer's transformer layer is built from the last decoder layer's spec.
    moe = (spec.num_layers - 1 if is_mtp else int(layer)) in spec.moe_layers
    if kind == _DENSE and moe:
        return f"layer {layer} is an MoE layer, with no dense MLP"
    if kind == _MOE and not moe:
        return f"layer {layer} is a dense layer, with no experts"
    expert = match.groupdict().get("e")
    if expert is not None and int(expert) >= spec.num_experts:
        return f"expert {expert} is beyond num_experts={spec.num_experts}"
    return None


def _refuse(name: str, spec: ModelShape) -> None:
    for pattern, families, why in _REFUSED:
        if spec.family in families and pattern.search(name):
            raise ValueError(f"cannot convert {name!r} to HF {spec.family.value}: {why}")


def _rule(name: str, spec: ModelShape) -> tuple[list[str], Split]:
    """The HF names `name` becomes, and how its tensor splits into them."""
    _refuse(name, spec)
    for pattern, targets, split, kind, families in _RULES:
        match = pattern.match(name)
        if match is None or spec.family not in families:
            continue
        problem = _kind_problem(match, kind, spec)
        if problem is not None:
            raise ValueError(f"cannot convert {name!r}: {problem}")
        return [t.format(**match.groupdict()) for t in targets], split
    raise ValueError(f"cannot convert {name!r} to HF {spec.family}: no mapping for this Megatron name")


def _tied_copy(name: str, spec: ModelShape) -> bool:
    """The output layer of tied embeddings: HF's checkpoint holds the embedding alone."""
    return spec.tie_embeddings and name == "output_layer.weight"


def hf_targets(name: str, cfg: Shape) -> list[str]:
    """The HF names the whole Megatron tensor `name` becomes; raises as `to_hf` does, with no tensor."""
    spec = as_spec(cfg)
    experts = per_expert_names(name, spec.num_experts)
    if experts is not None:
        _refuse(name, spec)
        with read_as(name):
            return [target for expert in experts for target in _rule(expert, spec)[0]]
    targets = _rule(name, spec)[0]
    return [] if _tied_copy(name, spec) else targets


def to_hf(name: str, tensor: torch.Tensor, cfg: Shape) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors one whole Megatron tensor becomes: views of `tensor` where the split allows;
    none for the output layer of tied embeddings (a copy of the embedding, which HF holds once).

    Raises ValueError, naming the tensor, for a tensor the family has no counterpart for (MoE
    tensors in a dense family, `expert_bias` in Qwen3-MoE or Mixtral, TEGroupedMLP's layout, the
    test-only `fp32_output_scale`), any name the mapping does not know, a layer or expert index
    beyond the model's, a dense MLP in an MoE layer or experts in a dense one, and a shape that
    does not match.
    """
    spec = as_spec(cfg)
    if per_expert_names(name, spec.num_experts) is not None:  # a GroupedMLP's weight1/2
        _refuse(name, spec)
        experts = per_expert(name, tensor, spec.num_experts, spec.hidden_size)
        with read_as(name):
            return [pair for expert, view, _ in experts for pair in to_hf(expert, view, spec)]
    hf, split = _rule(name, spec)
    expected = _expected_source_shape(hf, spec)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"cannot convert {name!r}: shape {tuple(tensor.shape)}, expected {expected} for this config")
    return [] if _tied_copy(name, spec) else list(zip(hf, split(tensor, spec), strict=True))


def convert(named: Iterable[tuple[str, torch.Tensor]], cfg: Shape) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_hf` over whole tensors, lazily: the first unmappable tensor raises."""
    spec = as_spec(cfg)
    for name, tensor in named:
        yield from to_hf(name, tensor, spec)


def hf_names(cfg: Shape, *, mtp: bool = False) -> list[str]:
    """Every HF checkpoint name a complete sync produces (with `mtp`, the MTP layers' too, as
    `hf_buckets(..., mtp=True)` sends them); for a dense family in the model's `named_parameters`
    order."""
    spec = as_spec(cfg)
    attention = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if spec.mla:
        attention = mla.attention_names(spec) + dsa.indexer_names(spec)
    if spec.qkv_bias:
        attention += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if spec.qk_layernorm and not spec.mla:
        attention += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]

    def layer(i: int) -> list[str]:
        if i not in spec.moe_layers:
            mlp = [f"mlp.{p}.weight" for p in _GATED]
        elif spec.family in routed.ROUTED_FAMILIES:
            mlp = routed.moe_names(spec)
        elif spec.family is Family.MIXTRAL:
            mlp = [f"{name}.weight" for name in mixtral.moe_names(spec)]
        else:
            mlp = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}.weight" for e in range(spec.num_experts) for p in _GATED]
        return [*attention, *mlp, "input_layernorm.weight", "post_attention_layernorm.weight"]

    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        names += [f"model.layers.{i}.{name}" for name in layer(i)]
    extra = mtp_layers.mtp_names(spec, layer(spec.num_layers - 1)) if mtp else []
    return [*names, *extra, "model.norm.weight", *([] if spec.tie_embeddings else ["lm_head.weight"])]


_GATED = ("gate_proj", "up_proj", "down_proj")
