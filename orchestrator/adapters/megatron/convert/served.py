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

from orchestrator.adapters.megatron.convert.spec import ModelSpec
from orchestrator.models import Architecture, Family, support_table

__all__ = ["served_problems"]


def served_problems(spec: ModelSpec, served: Architecture) -> list[str]:
    """Every way the HF config `served` differs from the Megatron model `spec` describes; empty
    when an engine that loads it computes what the trainer does."""
    if served.family is None:
        return [
            f"{served.source}: model_type {served.model_type!r} is no family the converter maps to; "
            f"it maps to:\n{support_table()}"
        ]
    if served.family is not spec.family:
        return [f"{served.source}: the engine serves {served.family.value}, the trainer's model is {spec.family.value}"]
    return [
        f"{served.source}: {what} is {theirs!r} there, {ours!r} in the trainer's model"
        for what, ours, theirs in _pairs(spec, served)
        if not _same(ours, theirs)
    ]


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return math.isclose(float(ours), float(theirs), rel_tol=1e-6)
    return bool(ours == theirs)


def _pairs(spec: ModelSpec, served: Architecture) -> list[tuple[str, Any, Any]]:
    """(what, the trainer's value, the served config's value), for everything an engine builds
    or computes from its config."""
    pairs: list[tuple[str, Any, Any]] = [
        ("vocab_size (Megatron's padded vocabulary must be the checkpoint's)", spec.vocab_size, served.vocab_size),
        ("hidden_size", spec.hidden_size, served.hidden_size),
        ("num_hidden_layers", spec.num_layers, served.num_layers),
        ("num_attention_heads", spec.num_attention_heads, served.num_attention_heads),
        ("tie_word_embeddings", spec.tie_embeddings, served.tie_embeddings),
        ("rope_theta", spec.rotary_base, served.rope_theta),
        ("partial_rotary_factor", spec.rotary_percent, served.partial_rotary_factor),
        ("attention q/k/v biases", spec.qkv_bias, served.qkv_bias),
    ]
    if spec.multi_latent_attention:
        pairs += [
            ("q_lora_rank", spec.q_lora_rank, served.q_lora_rank),
            ("kv_lora_rank", spec.kv_lora_rank, served.kv_lora_rank),
            ("qk_nope_head_dim", spec.qk_nope_head_dim, served.qk_nope_head_dim),
            ("qk_rope_head_dim", spec.qk_rope_head_dim, served.qk_rope_head_dim),
            ("v_head_dim", spec.v_head_dim, served.v_head_dim),
            ("YaRN factor", spec.yarn_factor or 1.0, served.rope_factor if served.rope_scaling == "yarn" else 1.0),
        ]
    else:
        pairs += [
            ("num_key_value_heads", spec.num_query_groups, served.num_kv_heads),
            ("head_dim", spec.head_dim, served.head_dim),
            ("q/k norm", spec.qk_layernorm, served.qk_norm),
        ]
    moe = set(spec.moe_layers)
    if len(moe) < spec.num_layers:
        pairs.append(("intermediate_size (the dense MLP's)", spec.ffn_hidden_size, served.ffn_hidden_size))
    pairs.append(("MoE layers", sorted(moe), [i for i, routed in enumerate(served.moe_layers) if routed]))
    if moe:
        pairs += [
            ("experts", spec.num_experts, served.num_experts),
            ("an expert's intermediate_size", spec.moe_ffn_hidden_size, served.moe_ffn_hidden_size),
            ("experts per token", spec.moe_router_topk, served.moe_router_topk),
            ("router score function", spec.moe_score_function, served.router_score),
            ("expert bias (e_score_correction_bias)", spec.expert_bias, served.expert_bias),
            ("shared experts' intermediate_size", spec.moe_shared_ffn_hidden_size, served.shared_expert_ffn),
            ("n_group", spec.moe_router_num_groups, served.n_group),
            ("topk_group", spec.moe_router_group_topk, served.topk_group),
            ("routed_scaling_factor", spec.moe_routed_scaling_factor, served.routed_scaling_factor),
        ]
        if spec.family is not Family.MIXTRAL:  # Mixtral always renormalises: its config has no key
            pairs.append(("norm_topk_prob", spec.moe_norm_topk_prob, served.norm_topk_prob))
    return pairs
