"""Does the engine serve the model the trainer trains? The converter's spec against the HF config.

An engine loads its model from an HF checkpoint; `update_weights` then overwrites its tensors by
name. A mismatch in a shape fails the load halfway, on the engine's side; a mismatch in what is
no shape (the RoPE base, the routed scale, q/k norms the engine never built, tied embeddings)
loads cleanly and serves another policy. So the served `config.json` is read with the same
reader the planner uses (`orchestrator.models.read_config`) and compared with what the
conversion read from Megatron's configs, before anything moves.

    problems = served_problems(model_spec(chunks), read_config(json.load(f), source=path))
"""

from __future__ import annotations

import math
from typing import Any

from orchestrator.models import Family, ModelShape, support_table

__all__ = ["served_problems"]


def served_problems(spec: ModelShape, served: ModelShape) -> list[str]:
    """Every way the HF config's shape `served` differs from the Megatron model's `spec`; empty
    when an engine that loads it computes what the trainer does."""
    if served.family is None:
        return [
            f"{served.source}: model_type {served.model_type!r} is no family the converter maps to; "
            f"it maps to:\n{support_table()}"
        ]
    if served.family is not spec.family:
        family = spec.family.value if spec.family else None
        return [f"{served.source}: the engine serves {served.family.value}, the trainer's model is {family}"]
    return [
        f"{served.source}: {what} is {theirs!r} there, {ours!r} in the trainer's model"
        for what, ours, theirs in _pairs(spec, served)
        if not _same(ours, theirs)
    ]


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return math.isclose(float(ours), float(theirs), rel_tol=1e-6)
    return bool(ours == theirs)


# (what, the field both shapes hold it in), for everything an engine builds or computes from its config
_ALWAYS = (
    ("vocab_size (Megatron's padded vocabulary must be the checkpoint's)", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("tie_word_embeddings", "tie_embeddings"),
    ("rope_theta", "rotary_base"),
    ("partial_rotary_factor", "rotary_percent"),
    ("attention q/k/v biases", "qkv_bias"),
)
_MLA = (
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("YaRN factor", "yarn_factor"),
)
_GQA = (("num_key_value_heads", "num_query_groups"), ("head_dim", "kv_channels"), ("q/k norm", "qk_layernorm"))
_MOE = (
    ("experts", "num_experts"),
    ("an expert's intermediate_size", "moe_ffn_hidden_size"),
    ("experts per token", "moe_router_topk"),
    ("router score function", "moe_score_function"),
    ("expert bias (e_score_correction_bias)", "expert_bias"),
    ("shared experts' intermediate_size", "moe_shared_ffn_hidden_size"),
    ("n_group", "moe_router_num_groups"),
    ("topk_group", "moe_router_group_topk"),
    ("routed_scaling_factor", "moe_routed_scaling_factor"),
)


def _value(shape: ModelShape, field: str) -> Any:
    if field == "yarn_factor":
        return shape.rope_factor if shape.yarn else 1.0
    return getattr(shape, field)


def _pairs(spec: ModelShape, served: ModelShape) -> list[tuple[str, Any, Any]]:
    """(what, the trainer's value, the served config's value), for everything an engine builds
    or computes from its config."""
    compared = [*_ALWAYS, *(_MLA if spec.mla else _GQA)]
    if spec.dense_layers:
        compared.append(("intermediate_size (the dense MLP's)", "ffn_hidden_size"))
    pairs = [(what, _value(spec, f), _value(served, f)) for what, f in compared]
    pairs.append(("MoE layers", sorted(spec.moe_layers), sorted(served.moe_layers)))
    if spec.moe_layers:
        moe = [*_MOE]
        if spec.family is not Family.MIXTRAL:  # Mixtral always renormalises: its config has no key
            moe.append(("norm_topk_prob", "moe_norm_topk_prob"))
        pairs += [(what, _value(spec, f), _value(served, f)) for what, f in moe]
    return pairs
