"""Does the engine serve the model the trainer trains? The converter's spec against the HF config.

An engine loads its model from an HF checkpoint; `update_weights` then overwrites its tensors by
name. A mismatch in a shape fails the load halfway, on the engine's side; a mismatch in what is
no shape (the RoPE base, YaRN's scales, the norms' eps, the routed scale, the indexer's top-k,
q/k norms the engine never built, tied embeddings) loads cleanly and serves another policy. So
the served `config.json` is read with the same reader the planner uses
(`orchestrator.models.read_config`) and compared with what the conversion read from Megatron's
configs, before anything moves.

    problems = served_problems(model_spec(chunks), read_config(json.load(f), source=path))

`SERVED_KEYS` lists, per family, every config key compared: each is a key whose value the
family's transformers class (its `configuration_<type>.py` and `modeling_<type>.py`, transformers
5) builds or computes with. A problem names the key, so a user can find it in the config.json.
Keys a family's class reads but that change nothing for a model the converter accepts are left
out on purpose: `topk_method` and `scoring_func` (DeepSeek-V3's and GLM's routers are sigmoid
with the correction bias whatever they say), `max_position_embeddings` (no computation on
positions below it depends on it, except as YaRN's `original_max_position_embeddings` default,
which is compared), dropouts and `initializer_range` (training only; the weights are
overwritten).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.models import Family, ModelShape, support_table

__all__ = ["SERVED_KEYS", "check_served", "served_problems"]

Getter = Callable[[ModelShape], Any]


def _field(name: str) -> Getter:
    return lambda shape: getattr(shape, name)


def _yarn(name: str) -> Getter:
    """A YaRN parameter, where the model scales its RoPE by YaRN (None elsewhere: not used)."""
    return lambda shape: getattr(shape, name) if shape.yarn else None


# (config key, what the trainer's shape says, what the served shape says): one row per key. The
# trainer's side reads the Megatron model's shape, the served side the config's; where they
# differ in how they hold it, the row says so.
_Row = tuple[str, Getter, Getter]


def _row(key: str, field: str) -> _Row:
    return key, _field(field), _field(field)


_ALWAYS: tuple[_Row, ...] = (
    _row("vocab_size", "vocab_size"),
    _row("hidden_size", "hidden_size"),
    _row("num_hidden_layers", "num_layers"),
    _row("num_attention_heads", "num_attention_heads"),
    _row("tie_word_embeddings", "tie_embeddings"),
    _row("rms_norm_eps", "layernorm_epsilon"),
    _row("hidden_act", "activation_func"),
    _row("rope_theta", "rotary_base"),
    _row("partial_rotary_factor", "rotary_percent"),
    _row("rope_type", "rope_scaling"),
    _row("attention_bias", "qkv_bias"),
)
_YARN: tuple[_Row, ...] = tuple(
    (key, _yarn(field), _yarn(field))
    for key, field in (
        ("factor", "rope_factor"),
        ("original_max_position_embeddings", "yarn_original_max_position_embeddings"),
        ("beta_fast", "yarn_beta_fast"),
        ("beta_slow", "yarn_beta_slow"),
        ("mscale", "yarn_mscale"),
        ("mscale_all_dim", "yarn_mscale_all_dim"),
        ("attention_factor", "yarn_attention_factor"),
        ("truncate", "yarn_truncate"),
    )
)
_MLA: tuple[_Row, ...] = (
    *(_row(key, key) for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")),
    # Megatron's MLA rotates interleaved pairs whatever its config says (HF's GQA classes read no such key)
    ("rope_interleave", lambda s: True, _field("rotary_interleaved")),
)
_DSA: tuple[_Row, ...] = (
    _row("index_topk", "dsa_index_topk"),
    _row("index_n_heads", "dsa_index_n_heads"),
    _row("index_head_dim", "dsa_index_head_dim"),
    ("indexer_types", lambda s: list(s.dsa_shared_index_layers), lambda s: list(s.dsa_shared_index_layers)),
)
# Qwen3's q/k norm is its model_type's (compared as the family), GLM-4.5's its use_qk_norm's
_GQA: tuple[_Row, ...] = (_row("num_key_value_heads", "num_query_groups"), _row("head_dim", "kv_channels"))
_DENSE: tuple[_Row, ...] = (_row("intermediate_size", "ffn_hidden_size"),)
_MOE_LAYERS: _Row = ("first_k_dense_replace", lambda s: sorted(s.moe_layers), lambda s: sorted(s.moe_layers))
_MOE: tuple[_Row, ...] = (
    _row("num_experts_per_tok", "moe_router_topk"),
    _row("norm_topk_prob", "moe_norm_topk_prob"),
)
# DeepSeek-style routing (routed.py): experts of their own size, groups, a scale, shared experts
_ROUTED: tuple[_Row, ...] = (
    _row("n_routed_experts", "num_experts"),
    _row("moe_intermediate_size", "moe_ffn_hidden_size"),
    _row("n_shared_experts", "moe_shared_ffn_hidden_size"),
    _row("n_group", "moe_router_num_groups"),
    _row("topk_group", "moe_router_group_topk"),
    _row("routed_scaling_factor", "moe_routed_scaling_factor"),
)
_QWEN3_MOE: tuple[_Row, ...] = (
    _row("num_experts", "num_experts"),
    _row("moe_intermediate_size", "moe_ffn_hidden_size"),
)
_MIXTRAL: tuple[_Row, ...] = (
    _row("num_local_experts", "num_experts"),
    _row("intermediate_size", "moe_ffn_hidden_size"),
)

_ROWS: dict[Family, tuple[_Row, ...]] = {
    Family.LLAMA: (*_ALWAYS, *_GQA, *_DENSE),
    Family.QWEN3: (*_ALWAYS, *_GQA, *_DENSE),
    Family.QWEN3_MOE: (*_ALWAYS, *_GQA, *_DENSE, _MOE_LAYERS, *_MOE, *_QWEN3_MOE),
    # Mixtral always renormalises: its config has no norm_topk_prob, and every layer is MoE
    Family.MIXTRAL: (*_ALWAYS, *_GQA, _MOE_LAYERS, _MOE[0], *_MIXTRAL),
    Family.GLM4_MOE: (*_ALWAYS, *_GQA, _row("use_qk_norm", "qk_layernorm"), *_DENSE, _MOE_LAYERS, *_MOE, *_ROUTED),
    Family.DEEPSEEK_V3: (*_ALWAYS, *_YARN, *_MLA, *_DENSE, _MOE_LAYERS, *_MOE, *_ROUTED),
    Family.GLM_MOE_DSA: (*_ALWAYS, *_YARN, *_MLA, *_DSA, *_DENSE, _MOE_LAYERS, *_MOE, *_ROUTED),
}
SERVED_KEYS: dict[Family, tuple[str, ...]] = {family: tuple(row[0] for row in rows) for family, rows in _ROWS.items()}


def served_problems(spec: ModelShape, served: ModelShape) -> list[str]:
    """Every way the HF config's shape `served` differs from the Megatron model's `spec`; empty
    when an engine that loads it computes what the trainer does. Each problem names the config key."""
    if served.family is None:
        return [
            f"{served.source}: model_type {served.model_type!r} is no family the converter maps to; "
            f"it maps to:\n{support_table()}"
        ]
    if served.family is not spec.family:
        family = spec.family.value if spec.family else None
        return [f"{served.source}: the engine serves {served.family.value}, the trainer's model is {family}"]
    out = []
    for key, trainer, engine in _ROWS[spec.family]:
        ours, theirs = trainer(spec), engine(served)
        if not _same(ours, theirs):
            out.append(f"{served.source}: {_label(key)} is {_show(theirs)} there, {_show(ours)} in the trainer's model")
    return out


def check_served(spec: ModelShape, served: ModelShape) -> None:
    """`served_problems`, raised as one ConfigError naming each (nothing when there are none)."""
    problems = served_problems(spec, served)
    if problems:
        raise ConfigError(problems)


def _label(key: str) -> str:
    if key == "first_k_dense_replace":  # compared as the MoE layers it makes
        return "the MoE layers (first_k_dense_replace, mlp_layer_types)"
    if key == "indexer_types":
        return "the 'shared' layers of indexer_types"
    if key == "n_shared_experts":  # compared as their summed FFN width
        return "n_shared_experts x moe_intermediate_size"
    return key


def _show(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6 and value == list(range(value[0], value[-1] + 1)):
        return f"{value[0]}..{value[-1]}"
    return repr(value)


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        if ours is None or theirs is None:
            return ours is theirs
        return math.isclose(float(ours), float(theirs), rel_tol=1e-6)
    return bool(ours == theirs)
