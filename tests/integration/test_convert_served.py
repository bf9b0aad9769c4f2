"""The converter reads the served HF config with the planner's reader (`orchestrator.models`):
the config it writes for a family reads back as the same model, a config that differs in what an
engine computes is named before anything moves, key by key (`SERVED_KEYS`), and the published
configs (orchestrator/models/published/) pass unchanged against the Megatron model built from them."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

pytest.importorskip("transformers")

from orchestrator.adapters.megatron.convert import hf_config
from orchestrator.adapters.megatron.convert.served import SERVED_KEYS, check_served, served_problems
from orchestrator.errors import ConfigError
from orchestrator.models import Family, ModelShape, read_config
from orchestrator.plan.presets import published_config
from tests.integration.test_convert_deepseek import DEEPSEEK, GLM
from tests.integration.test_convert_tied_mixtral_grouped import LLAMA_TIED, MIXTRAL, QWEN3_MOE, QWEN3_TIED
from tests.support.published_trainer import trainer_shape

SPECS = {"llama tied": LLAMA_TIED, "qwen3 tied": QWEN3_TIED, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}
SPECS |= {"deepseek_v3": DEEPSEEK, "glm4_moe": GLM}


def _served(spec: ModelShape, **change: object) -> object:
    config = hf_config(spec).to_dict() | change
    return read_config(config, source="served/config.json")


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_the_config_the_converter_writes_reads_back_as_its_model(spec: ModelShape) -> None:
    assert served_problems(spec, _served(spec)) == []


@pytest.mark.parametrize(
    ("spec", "change", "named"),
    [
        (QWEN3_TIED, {"tie_word_embeddings": False}, "tie_word_embeddings is False there, True"),
        (QWEN3_TIED, {"model_type": "llama"}, "the engine serves llama, the trainer's model is qwen3"),
        (MIXTRAL, {"num_experts_per_tok": 1}, "num_experts_per_tok is 1 there, 2"),
        (DEEPSEEK, {"routed_scaling_factor": 1.0}, "routed_scaling_factor is 1.0 there, 2.5"),
        (
            GLM,
            {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 1.0}},
            "partial_rotary_factor is 1.0 there, 0.5",
        ),
    ],
    ids=["tied", "family", "topk", "routed-scale", "partial-rotary"],
)
def test_a_served_config_that_computes_otherwise_is_named(spec: ModelShape, change: dict, named: str) -> None:
    problems = served_problems(spec, _served(spec, **change))
    assert any(named in p for p in problems), problems


def test_a_model_type_no_family_maps_to_lists_the_families() -> None:
    (problem,) = served_problems(QWEN3_TIED, _served(QWEN3_TIED, model_type="gemma3_text"))
    assert "'gemma3_text' is no family" in problem and "deepseek_v3" in problem


# ---- the published configs -------------------------------------------------------------------------

PUBLISHED_FAMILIES = {
    "qwen3-4b": Family.QWEN3,
    "deepseek-v3": Family.DEEPSEEK_V3,
    "glm-4.5": Family.GLM4_MOE,
    "glm-5": Family.GLM_MOE_DSA,
}
_ROPE_KEYS = {"rope_theta", "partial_rotary_factor", "rope_type", "factor", "original_max_position_embeddings"}
_ROPE_KEYS |= {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
_YARN_KEYS = _ROPE_KEYS - {"rope_theta", "partial_rotary_factor", "rope_type"}


def _rope(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config's RoPE dict (transformers 5's `rope_parameters`, or the older `rope_scaling`)."""
    return config.get("rope_parameters") or config.get("rope_scaling")


def _applies(name: str, key: str) -> str:
    """Why flipping `key` in `name`'s config changes nothing an engine computes ("" if it does)."""
    config = published_config(name)
    rope = _rope(config) or {}
    if key in _YARN_KEYS and (rope.get("rope_type") or rope.get("type")) != "yarn":
        return "YaRN's keys do nothing without YaRN"
    if key == "topk_group" and config.get("n_group", 1) <= 1:
        return "one group: HF takes the top topk_group of one group score"
    return ""


def _flipped(config: dict[str, Any], key: str) -> dict[str, Any]:
    """`config` with `key` set to another value an engine would build or compute otherwise with."""
    config = copy.deepcopy(config)
    rope = _rope(config)
    where = rope if key in _ROPE_KEYS and rope is not None and (key in rope or key not in config) else config
    if key == "rope_type":
        if rope is None:
            config["rope_scaling"] = where = {}
        else:
            where = rope
        was = where.get("rope_type") or where.get("type") or "default"
        yarn = {"factor": 4.0, "original_max_position_embeddings": 4096}
        where |= {"rope_type": "default"} if was == "yarn" else {"rope_type": "yarn", **yarn}
        return config
    if key == "indexer_types":
        config[key] = ["shared" if i == 4 else "full" for i in range(config["num_hidden_layers"])]
        return config
    # a key the config leaves to its class's default: set to another value
    absent = {"attention_factor": 0.5, "truncate": False, "rope_interleave": False, "use_qk_norm": True}
    absent |= {"partial_rotary_factor": 0.5}
    if key not in where:
        where[key] = absent[key]
        return config
    value = where[key]
    changed: Any
    if isinstance(value, bool):
        changed = not value
    elif key in ("first_k_dense_replace", "n_shared_experts"):
        changed = value + 1
    elif key == "original_max_position_embeddings":
        changed = value // 2
    elif key == "rms_norm_eps":
        changed = value * 10
    elif key == "partial_rotary_factor":
        changed = (value or 1.0) / 2
    elif key == "hidden_act":
        changed = "gelu"
    elif isinstance(value, int | float):
        changed = value * 2
    else:
        raise AssertionError(f"no flip for {key}={value!r}: say how to change it here")
    where[key] = changed
    return config


FLIPS = [
    (name, key)
    for name, family in PUBLISHED_FAMILIES.items()
    for key in SERVED_KEYS[family]
    if key != "vocab_size" or name == "qwen3-4b"  # a vocabulary is one number: one model suffices
]


@pytest.mark.parametrize("name", PUBLISHED_FAMILIES)
def test_a_published_config_is_served_as_the_model_megatron_builds_from_it(name: str) -> None:
    """GLM-5's n_group 1 included: one group of every expert is Megatron's no groups."""
    config = published_config(name)
    trainer = trainer_shape(config, PUBLISHED_FAMILIES[name])
    check_served(trainer, read_config(config, source=f"{name}.json"))


@pytest.mark.parametrize(("name", "key"), FLIPS, ids=[f"{n}-{k}" for n, k in FLIPS])
def test_each_compared_key_changed_in_a_published_config_is_named(name: str, key: str) -> None:
    why_not = _applies(name, key)
    if why_not:
        pytest.skip(why_not)
    trainer = trainer_shape(published_config(name), PUBLISHED_FAMILIES[name])
    served = _flipped(published_config(name), key)
    with pytest.raises(ConfigError, match=rf"(?:^|[\s(]){re.escape(key)}(?: is|,| x )"):
        check_served(trainer, read_config(served, source=f"{name}.json"))


def test_every_compared_key_of_a_published_family_is_flipped_in_one_of_the_configs() -> None:
    flipped = {key for name, key in FLIPS if not _applies(name, key)}
    assert {k for name, f in PUBLISHED_FAMILIES.items() for k in SERVED_KEYS[f]} == flipped


@pytest.mark.parametrize(
    ("name", "change", "named"),
    [
        ("glm-5", {"index_topk": 4096}, "index_topk is 4096 there, 2048"),
        ("glm-5", {"rms_norm_eps": 1e-4}, "rms_norm_eps is 0.0001 there, 1e-05"),
        ("deepseek-v3", {"rope_scaling": {"mscale_all_dim": 0.5}}, "mscale_all_dim is 0.5 there, 1.0"),
        ("deepseek-v3", {"rope_scaling": {"original_max_position_embeddings": 2048}}, "is 2048 there, 4096"),
    ],
    ids=["index-topk", "norm-eps", "mscale-all-dim", "original-positions"],
)
def test_the_issues_accepted_changes_are_refused(name: str, change: dict[str, Any], named: str) -> None:
    """The four that served_config once accepted though each serves another function (issue 39)."""
    config = published_config(name)
    trainer = trainer_shape(config, PUBLISHED_FAMILIES[name])
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    problems = served_problems(trainer, read_config(config, source="c"))
    assert any(named in p for p in problems), problems
