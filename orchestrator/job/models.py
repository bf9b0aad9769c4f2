"""The seed's workloads and any HF `config.json`, as the job trains them: `family_model`.

    model = family_model("glm-5", layers=3, experts=16)    # a published config, shrunk
    model = family_model(Path("config.json"))              # a user's, whole

A family model is a `GPTConfig`: Megatron-core builds it from the config's shape by its own spec
functions for the family (`megatron_build.build_gpt`), with random init (nothing is downloaded),
and the engine builds the family's own transformers class from the same config (`served`), which
each rank checks its model against (`served_config`) before any weight is sent.

Shrinking keeps the published widths and every feature: `layers` keeps one dense layer first
where the model has dense and MoE layers, and MoE for the rest; `experts` keeps the routing
groups whole. What the job changes beyond that is said in `GPTConfig.shrunk`, one phrase each:
MTP layers the converter does not map are left out (it maps GLM-5's; transformers' DeepSeek-V3
class has none), and an MLA model's norm eps is the one HF's latent norms hard-code, since Megatron has one
eps for every norm (GLM-5 publishes 1e-5; its `q_a_layernorm` and `kv_a_layernorm` use 1e-6).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.adapters.megatron.convert.mla import MLA_NORM_EPS
from orchestrator.adapters.megatron.convert.mtp import MTP_FAMILIES
from orchestrator.adapters.megatron.gpt import GPTConfig, TinyGPTConfig
from orchestrator.errors import ConfigError
from orchestrator.models import Family, read_config
from orchestrator.plan.presets import PUBLISHED_MODELS, published_config

__all__ = ["FAMILY_LR", "FAMILY_MODELS", "describe", "family_model", "shrink"]

# The seed's workloads, by the names `colocate run --model` takes (their published configs).
FAMILY_MODELS: tuple[str, ...] = ("qwen3-4b", "deepseek-v3", "glm-5")
# The GPU presets' rate (presets.py): the usual one for a model of 1-4 B trained from scratch.
FAMILY_LR = 2e-4
# What a random-init bf16 model has no use for: FP8 checkpoint scales, the hub's own code.
_DROPPED = ("quantization_config", "auto_map")
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
_PER_LAYER_KEYS = ("mlp_layer_types", "indexer_types", "layer_types")


def family_model(
    source: str | Path | Mapping[str, Any],
    *,
    layers: int | None = None,
    experts: int | None = None,
    **settings: Any,
) -> GPTConfig:
    """The GPT of `source` (a name of `FAMILY_MODELS` or of `PUBLISHED_MODELS`, a config.json or
    its folder, or the config itself), with at most `layers` layers and `experts` routed experts,
    trained with `settings` (`GPTConfig`'s seq_len, seed, lr, clip_grad). ConfigError naming
    each problem otherwise, the families it builds among them."""
    name, config = _source(source)
    served, shrunk = shrink(config, layers=layers, experts=experts)
    shape = read_config(served, source=name)
    if shape.family is None:
        known = ", ".join(f.value for f in Family)
        raise ConfigError([f"{name}: model_type {shape.model_type!r} is no family colocate converts ({known})"])
    settings.setdefault("lr", FAMILY_LR)
    init = served.get("initializer_range", 0.02)
    return GPTConfig(model=shape, served=served, shrunk=shrunk, init_method_std=init, **settings)


def shrink(
    config: Mapping[str, Any], *, layers: int | None = None, experts: int | None = None
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`config` as the job serves it, and what was changed, one phrase each (see the module)."""
    out = {k: v for k, v in config.items() if k not in _DROPPED}
    problems: list[str] = []
    notes = [f"{key} dropped (random init in bf16)" for key in _DROPPED if key in config]
    if layers is not None:
        notes += _layers(out, layers, problems)
    if experts is not None:
        notes += _experts(out, experts, problems)
    if problems:
        raise ConfigError(problems)
    family = out.get("model_type")
    if out.get("num_nextn_predict_layers") and family not in MTP_FAMILIES:
        notes.append(f"{out['num_nextn_predict_layers']} MTP layer(s) left out: colocate converts GLM-5's only")
        out["num_nextn_predict_layers"] = 0
    if out.get("kv_lora_rank") and out.get("rms_norm_eps", MLA_NORM_EPS) != MLA_NORM_EPS:
        notes.append(
            f"rms_norm_eps {out['rms_norm_eps']:g} → {MLA_NORM_EPS:g}: Megatron has one eps, and HF's MLA latent "
            f"norms use {MLA_NORM_EPS:g}"
        )
        out["rms_norm_eps"] = MLA_NORM_EPS
    return out, tuple(notes)


def _layers(out: dict[str, Any], layers: int, problems: list[str]) -> list[str]:
    total = out.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers <= total:
        problems.append(f"--layers must be in 1..{total} (the model's num_hidden_layers), got {layers}")
        return []
    if layers == total:
        return []
    moe = any(out.get(k) for k in _EXPERT_KEYS)
    dense_first = int(out.get("first_k_dense_replace") or 0)
    if isinstance(out.get("mlp_layer_types"), list):
        dense_first = out["mlp_layer_types"].count("dense")
    # One dense layer first where the model has both kinds, and MoE in the rest.
    dense = min(dense_first, 1) if moe and layers > 1 else (0 if moe else layers)
    for key in _PER_LAYER_KEYS:
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    if isinstance(out.get("mlp_layer_types"), list):
        out["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    if "first_k_dense_replace" in out:
        out["first_k_dense_replace"] = dense
    if isinstance(out.get("max_window_layers"), int):
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    out["num_hidden_layers"] = layers
    kept = f", {dense} dense and {layers - dense} MoE" if moe else ""
    return [f"{layers} of {total} layers{kept}"]


def _experts(out: dict[str, Any], experts: int, problems: list[str]) -> list[str]:
    key = next((k for k in _EXPERT_KEYS if out.get(k)), None)
    if key is None:
        problems.append("--experts is for a model with routed experts; this one has none")
        return []
    total, topk = out[key], int(out.get("num_experts_per_tok") or 1)
    groups, topk_group = int(out.get("n_group") or 1), int(out.get("topk_group") or 1)
    if not topk <= experts <= total:
        problems.append(f"--experts must be in {topk}..{total} (num_experts_per_tok..{key}), got {experts}")
    elif groups > 1 and (experts % groups or experts // groups * topk_group < topk):
        # Both HF and Megatron pick topk_group groups of n_group, then the top-k experts among them.
        problems.append(
            f"--experts {experts} does not route as the model does: it must split into n_group={groups} "
            f"equal groups, of which topk_group={topk_group} hold at least num_experts_per_tok={topk}"
        )
    if problems:
        return []
    out[key] = experts
    return [f"{experts} of {total} experts"] if experts < total else []


def _source(source: str | Path | Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(a name for messages, the config) of a built-in name, a path or a mapping."""
    if isinstance(source, Mapping):
        return "config", source
    if isinstance(source, str) and source in PUBLISHED_MODELS:
        return source, published_config(source)
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError([f"{source}: no such config.json, and not a built-in model ({', '.join(FAMILY_MODELS)})"])
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError([f"{path}: cannot read it as JSON: {error}"]) from None
    if not isinstance(config, Mapping):
        raise ConfigError([f"{path}: not a JSON object"])
    return str(path), config


def describe(model: TinyGPTConfig | GPTConfig) -> str:
    """One line for the run's summary: the model's source and family, and what was shrunk."""
    if isinstance(model, TinyGPTConfig):
        return f"colocate's Llama-shaped GPT: hidden {model.hidden_size}, {model.num_layers} layers"
    shape = model.model
    return "; ".join(
        (f"{shape.source} ({shape.family}, {', '.join(shape.architectures) or 'no class named'})", *model.shrunk)
    )
