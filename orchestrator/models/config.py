"""The one reader of HF model configs: a config.json's mapping to a `ModelShape`.

    arch = read_config(json.loads(path.read_text()), source=str(path))
    arch = read_config(hf_config(spec).to_dict(), source="hf_config(spec)")

A multimodal config nests its text model in `text_config`: its keys are read there first, then
at the top level (`tie_word_embeddings`, `architectures` live there), and the rest of the model
(a vision tower) is named in `not_counted`. What a config leaves to its `model_type` (Gemma's
tied embeddings, Qwen2's q/k/v biases, Qwen3's q/k norms) comes from `hf_types`.

Every problem is collected and raised at once as one ConfigError naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.models.families import Family
from orchestrator.models.hf_types import Bias, QKNorm, TypeFacts, facts_for, type_of_class
from orchestrator.models.shape import ModelShape

__all__ = ["read_config"]

_MISSING = object()


class _Keys:
    """Typed look-ups, the text model's keys first, then the top level's; problems collected."""

    def __init__(self, top: Mapping[str, Any], text: Mapping[str, Any]) -> None:
        self.top, self.text = top, text
        self.problems: list[str] = []

    def has(self, key: str) -> bool:
        return self.raw(key) is not None

    def raw(self, key: str) -> Any:
        value = self.text.get(key, _MISSING)
        return self.top.get(key) if value is _MISSING else value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 0) -> int:
        """`key`'s integer; absent or null gives `default`, and without one it is a problem."""
        value = self.raw(key)
        if value is None:
            if default is None:
                self.problems.append(f"missing {key!r}" if not self._present(key) else f"{key} is null, not an integer")
            return default or 0
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{key} must be an integer, got {value!r}")
            return 0
        if value < minimum:
            self.problems.append(f"{key} must be >= {minimum}, got {value}")
            return 0
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            self.problems.append(f"{key} must be a non-negative number, got {value!r}")
            return default
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problems.append(f"{key} must be true or false, got {value!r}")
            return default
        return value

    def layer_list(self, key: str, layers: int) -> list[int]:
        """A list of layer indices, each in [0, layers)."""
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            self.problems.append(f"{key} must be a list of layer indices, got {value!r}")
            return []
        bad = [i for i in value if not 0 <= i < layers]
        if bad:
            self.problems.append(f"{key} names layers {bad} outside the model's {layers} (0..{layers - 1})")
        return value

    def _present(self, key: str) -> bool:
        return key in self.text or key in self.top


def read_config(mapping: Mapping[str, Any], *, source: str) -> ModelShape:
    """An HF config (a config.json's object, or a `PretrainedConfig.to_dict()`) as a ModelShape.

    Raises ConfigError naming `source` and every key that is missing, mistyped or inconsistent."""
    if not isinstance(mapping, Mapping):
        raise ConfigError([f"{source}: not a JSON object"])
    text = mapping.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise ConfigError([f"{source}: text_config must be an object, got {text!r}"])
    keys = _Keys(mapping, text)
    listed = mapping.get("architectures") or []
    if not isinstance(listed, list):
        keys.problems.append(f"architectures must be a list of class names, got {listed!r}")
        listed = []
    architectures = tuple(str(a) for a in listed)
    model_type = str(mapping.get("model_type") or type_of_class(architectures))
    top_facts = facts_for(model_type)
    text_type = str(text.get("model_type") or (top_facts.text_type if top_facts else "") or model_type)
    # An unknown type reads as Llama does, its q/k norm as the key says.
    facts = facts_for(text_type) or TypeFacts(text_type, qk_norm=QKNorm.RMS_IF_KEY)

    fields = _shape(keys)
    fields |= (
        _experts(keys, facts, fields["num_layers"] or 1) | _attention_extras(keys, facts) | _positions(keys, facts)
    )
    fields |= _computed(keys, facts, fields["num_layers"] or 1)
    tie, assumed = _tie(keys, top_facts or facts, model_type)
    problems = keys.problems or _relations(fields, keys)
    if problems:
        raise ConfigError([f"{source}: {p}" for p in problems])
    return ModelShape(
        source=source,
        name=_name(mapping, architectures, model_type) or source,
        model_type=model_type,
        text_model_type=text_type,
        architectures=architectures,
        family=next((f for f in Family if f.value == model_type), None),
        tie_embeddings=tie,
        not_counted=_not_counted(mapping, keys, fields["kv_lora_rank"] > 0),
        assumed=assumed,
        **fields,
    )


def _shape(keys: _Keys) -> dict[str, Any]:
    hidden = keys.integer("hidden_size", minimum=1)
    heads = keys.integer("num_attention_heads", minimum=1)
    kv_lora_rank = keys.integer("kv_lora_rank", 0)
    return {
        "hidden_size": hidden,
        "num_layers": keys.integer("num_hidden_layers", minimum=1),
        "vocab_size": keys.integer("vocab_size", minimum=1),
        "num_attention_heads": heads,
        "num_query_groups": keys.integer("num_key_value_heads", heads or 1, minimum=1),
        # MLA's head dims are its own; GLM-5's config points `head_dim` at the RoPE slice.
        "head_dim": 0 if kv_lora_rank else keys.integer("head_dim", hidden // heads if heads else 1, minimum=1),
        "q_lora_rank": keys.integer("q_lora_rank", 0),
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": keys.integer("qk_nope_head_dim", 0),
        "qk_rope_head_dim": keys.integer("qk_rope_head_dim", 0),
        "v_head_dim": keys.integer("v_head_dim", 0),
        "dsa_index_n_heads": keys.integer("index_n_heads", 0),
        "dsa_index_head_dim": keys.integer("index_head_dim", 0),
        "dsa_index_topk": keys.integer("index_topk", 0),
        "mtp_num_layers": keys.integer("num_nextn_predict_layers", keys.integer("num_mtp_layers", 0)),
    }


def _experts(keys: _Keys, facts: TypeFacts, layers: int) -> dict[str, Any]:
    """The MLPs. Mixtral and Llama-4 name their expert FFN `intermediate_size` (Llama-4's dense
    one is `intermediate_size_mlp`); the others have `moe_intermediate_size`."""
    experts = next(
        (keys.integer(k, 0) for k in ("n_routed_experts", "num_experts", "num_local_experts") if keys.has(k)), 0
    )
    if not experts:
        return {"ffn_hidden_size": keys.integer("intermediate_size", 0), "moe_layers": ()}
    if keys.has("moe_intermediate_size"):
        moe_ffn, ffn = keys.integer("moe_intermediate_size"), keys.integer("intermediate_size", 0)
    else:
        moe_ffn, ffn = keys.integer("intermediate_size"), keys.integer("intermediate_size_mlp", 0)
    shared = keys.integer("n_shared_experts", facts.shared_experts) * moe_ffn or keys.integer(
        "shared_expert_intermediate_size", 0
    )
    topk_method = keys.raw("topk_method")
    return {
        "ffn_hidden_size": ffn,
        "moe_layers": _moe_layers(keys, layers),
        "num_experts": experts,
        "moe_ffn_hidden_size": moe_ffn,
        "moe_router_topk": keys.integer("num_experts_per_tok", minimum=1),
        "moe_shared_ffn_hidden_size": shared,
        "shared_expert_gate": facts.shared_expert_gate and shared > 0,
        "moe_score_function": str(keys.raw("scoring_func") or facts.router_score),
        "expert_bias": facts.expert_bias or topk_method == "noaux_tc",
        # HF's n_group 1 is one group of every expert: no grouping (ModelShape reads 1 as 0)
        "moe_router_num_groups": keys.integer("n_group", 0),
        "moe_router_group_topk": keys.integer("topk_group", 0),
        "moe_routed_scaling_factor": keys.number("routed_scaling_factor", 1.0),
        "moe_norm_topk_prob": keys.flag("norm_topk_prob", facts.norm_topk_prob),
    }


def _moe_layers(keys: _Keys, layers: int) -> tuple[int, ...]:
    """The layers that route to experts, by whichever rule the config's type uses."""
    types = keys.raw("mlp_layer_types")  # GLM-5: "dense" / "sparse" per layer
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"dense", "sparse"}:
            keys.problems.append(f"mlp_layer_types must list 'dense' or 'sparse' for each of {layers} layers")
            return ()
        return tuple(i for i, t in enumerate(types) if t == "sparse")
    if isinstance(keys.raw("moe_layers"), list):  # Llama-4, resolved
        return tuple(sorted(set(keys.layer_list("moe_layers", layers))))
    step = keys.integer("interleave_moe_layer_step", 0) or keys.integer("decoder_sparse_step", 1, minimum=1)
    first_dense = keys.integer("first_k_dense_replace", 0)
    freq = keys.integer("moe_layer_freq", 1, minimum=1)  # DeepSeek's: MoE where i % freq == 0
    dense = set(keys.layer_list("mlp_only_layers", layers))
    return tuple(
        i
        for i in range(layers)
        if i >= first_dense and (i + 1) % max(step, 1) == 0 and i % freq == 0 and i not in dense
    )


def _attention_extras(keys: _Keys, facts: TypeFacts) -> dict[str, Any]:
    bias = keys.flag(facts.bias_key, facts.bias_default) if facts.bias is Bias.KEY else facts.bias is Bias.QKV
    norm = keys.flag("use_qk_norm", facts.qk_norm_default)
    return {
        "qkv_bias": bias,
        "out_bias": bias and facts.o_bias and facts.bias is Bias.KEY,
        "qk_layernorm": facts.qk_norm is QKNorm.RMS or (facts.qk_norm is QKNorm.RMS_IF_KEY and norm),
        "qk_l2_norm": facts.qk_norm is QKNorm.L2_IF_KEY and norm,
        "sandwich_norms": facts.sandwich_norms,
    }


def _positions(keys: _Keys, facts: TypeFacts) -> dict[str, Any]:
    """RoPE: transformers 5's `rope_parameters`, or the older `rope_scaling` beside a top-level
    `rope_theta`; Gemma-3 keeps one per layer type (its full-attention one is read). YaRN's keys
    default as transformers' `_compute_yarn_parameters` defaults them (`original_max_position_embeddings`
    to `max_position_embeddings`, beta 32 and 1; `attention_factor` inferred from the mscales)."""
    rope = keys.raw("rope_parameters") or keys.raw("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        keys.problems.append(f"rope_parameters must be an object, got {rope!r}")
        rope = {}
    if rope and all(isinstance(v, Mapping) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    inner = _Keys({}, rope)
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    fields = {
        "rotary_base": inner.number("rope_theta", keys.number("rope_theta", 0.0)),
        "rope_scaling": "" if kind == "default" else kind,
        "rope_factor": inner.number("factor", 1.0),
        "rotary_percent": inner.number("partial_rotary_factor", keys.number("partial_rotary_factor", 1.0)),
        "rotary_interleaved": keys.flag("rope_interleave", facts.rope_interleave),
    }
    if kind == "yarn":
        original = inner.integer(
            "original_max_position_embeddings", keys.integer("max_position_embeddings", 0), minimum=1
        )
        fields |= {
            "yarn_original_max_position_embeddings": original,
            # HF reads a beta of 0 (or null) as its default
            "yarn_beta_fast": inner.number("beta_fast", 0.0) or 32.0,
            "yarn_beta_slow": inner.number("beta_slow", 0.0) or 1.0,
            "yarn_mscale": inner.number("mscale", 1.0),
            "yarn_mscale_all_dim": inner.number("mscale_all_dim", 0.0),
            "yarn_attention_factor": inner.number("attention_factor", 0.0),
            "yarn_truncate": inner.flag("truncate", True),
        }
    keys.problems += [f"rope: {p}" for p in inner.problems]
    return fields


def _computed(keys: _Keys, facts: TypeFacts, layers: int) -> dict[str, Any]:
    """What the engine computes with that no shape shows: the norms' eps, the activation, the
    DSA layers that reuse an earlier layer's top-k."""
    act = keys.raw("hidden_act") or keys.raw("hidden_activation") or "silu"
    return {
        "layernorm_epsilon": keys.number("rms_norm_eps", facts.norm_eps),
        "activation_func": str(act),
        "dsa_shared_index_layers": _shared_index_layers(keys, layers) if keys.has("index_n_heads") else (),
    }


def _shared_index_layers(keys: _Keys, layers: int) -> tuple[int, ...]:
    """GLM-5's `indexer_types` ("full" or "shared" per layer), or the schedule transformers'
    GlmMoeDsaConfig derives without one from `index_topk_freq` and `index_skip_topk_offset`."""
    types = keys.raw("indexer_types")
    if types is None:
        freq = max(keys.integer("index_topk_freq", 1, minimum=1), 1)
        offset = keys.integer("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"full", "shared"}:
        keys.problems.append(f"indexer_types must list 'full' or 'shared' for each of {layers} layers")
        return ()
    return tuple(i for i, t in enumerate(types) if t == "shared")


def _tie(keys: _Keys, facts: TypeFacts, model_type: str) -> tuple[bool, tuple[str, ...]]:
    """Tied embeddings: said where the model's LM head lives (the top level, or Llama-4's text
    model), else where the other one says it (pre-v5 VL saves put it in text_config), else the
    type's default."""
    places = (keys.text, keys.top) if facts.lm_head_in_text else (keys.top, keys.text)
    for place in places:
        value = place.get("tie_word_embeddings")
        if isinstance(value, bool):
            return value, ()
        if value is not None:
            keys.problems.append(f"tie_word_embeddings must be true or false, got {value!r}")
            return False, ()
    if facts_for(model_type) is not None or facts_for(facts.model_type) is not None:
        return facts.tie, ()
    return False, (f"tie_word_embeddings not given and model_type {model_type!r} unknown: counted untied",)


def _name(mapping: Mapping[str, Any], architectures: tuple[str, ...], model_type: str) -> str:
    path = mapping.get("_name_or_path")
    return str(path) if path else (architectures[0] if architectures else model_type)


def _not_counted(mapping: Mapping[str, Any], keys: _Keys, mla: bool) -> tuple[str, ...]:
    out = [
        f"the {key.removesuffix('_config')} encoder ({key}) and what joins it to the text model"
        for key, value in mapping.items()
        if key.endswith("_config") and key != "text_config" and isinstance(value, Mapping)
    ]
    if mla and keys.flag("attention_bias", False):
        out.append("MLA's projection biases (attention_bias)")
    if keys.flag("mlp_bias", False):
        out.append("MLP biases (mlp_bias)")
    return tuple(out)


def _relations(f: Mapping[str, Any], keys: _Keys) -> list[str]:
    """What the numbers (`ModelShape`'s fields) must satisfy together, named by their keys."""
    out = []
    if f["kv_lora_rank"]:
        if f["qk_nope_head_dim"] + f["qk_rope_head_dim"] <= 0 or f["v_head_dim"] <= 0:
            out.append("kv_lora_rank is set (MLA): qk_nope_head_dim + qk_rope_head_dim and v_head_dim must be > 0")
    elif f["num_attention_heads"] % f["num_query_groups"]:
        out.append(
            f"num_attention_heads ({f['num_attention_heads']}) must be a multiple of "
            f"num_key_value_heads ({f['num_query_groups']})"
        )
    if bool(f["dsa_index_n_heads"]) != bool(f["dsa_index_head_dim"]):
        out.append("the DSA indexer needs both index_n_heads and index_head_dim")
    elif f["dsa_index_n_heads"] and not f["q_lora_rank"]:
        out.append("the DSA indexer reads the q LoRA: index_n_heads needs q_lora_rank")
    dense_layers = f["num_layers"] - len(f["moe_layers"])
    experts = f.get("num_experts", 0)
    if dense_layers and f["ffn_hidden_size"] <= 0:
        dense_key = (
            "intermediate_size_mlp" if experts and not keys.has("moe_intermediate_size") else "intermediate_size"
        )
        out.append(f"{dense_key} must be > 0 for the {dense_layers} dense layers")
    if experts:
        if f["moe_ffn_hidden_size"] <= 0:
            out.append("the expert FFN size (moe_intermediate_size, or intermediate_size) must be > 0")
        if not 0 < f["moe_router_topk"] <= experts:
            out.append(f"num_experts_per_tok ({f['moe_router_topk']}) must be in 1..{experts} experts")
    return out
