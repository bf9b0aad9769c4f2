"""The converter reads the served HF config with the planner's reader (`orchestrator.models`):
the config it writes for a family reads back as the same model, and a config that differs in
what an engine computes is named before anything moves."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from orchestrator.adapters.megatron.convert import hf_config
from orchestrator.adapters.megatron.convert.served import served_problems
from orchestrator.models import ModelShape, read_config
from tests.integration.test_convert_deepseek import DEEPSEEK, GLM
from tests.integration.test_convert_tied_mixtral_grouped import LLAMA_TIED, MIXTRAL, QWEN3_MOE, QWEN3_TIED

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
