"""`colocate check`'s conversion group on real megatron-core and transformers, each model built on
the meta device in this process (a one-rank gloo group). Nothing is replaced: Megatron's own
build, the converter's `to_hf`, transformers' own class and reverse mapping, `MegatronTrainer`'s
sorting of params (DDP's buffers stood for by DDP's own rule, as the group says). Each check is
made to fail for its real reason, on a model or config that has it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from orchestrator.cli.plan.options import PlanOptions
from orchestrator.job.check import Outcome, SetUp
from orchestrator.job.check import conversion as c
from orchestrator.job.check.trainer import job_model, served_config


@pytest.fixture(scope="module")
def built() -> Iterator[dict[str, list[Any]]]:
    """`tiny` (what colocate run trains by default) and `cpu` (the restore benchmark's: an
    expert_bias, an fp32 param and a frozen one), on meta."""
    from orchestrator.adapters.megatron.build import meta_gpt

    with c.one_rank():
        yield {name: [meta_gpt(job_model(name))] for name in ("tiny", "cpu")}


def test_the_default_model_passes_every_row() -> None:
    found = {row.check: row for row in c.rows(SetUp(plan=PlanOptions(model="tiny").plan(), model="tiny"))}
    assert [row.outcome for row in found.values()] == [Outcome.OK] * 5, found
    assert (
        "each of the 21 checkpoint tensors transformers' LlamaForCausalLM loads is sent once"
        in found["hf coverage"].read
    )


def test_a_tensor_no_hf_family_has_fails_the_mapping_and_stops_the_group() -> None:
    """`cpu`'s MoE layer routes by sigmoid with an expert_bias and has no shared expert: HF's
    families that route so (GLM-4.5, DeepSeek-V3) all have one. `conversion_problems` says so,
    with the table of what colocate converts."""
    found = {row.check: row for row in c.rows(SetUp(plan=PlanOptions(model="cpu").plan(), model="cpu"))}
    row = found["megatron → hf names"]
    assert row.outcome is Outcome.FAIL and "no HF glm4_moe equivalent: shared experts of ffn 0" in row.read
    assert "colocate converts to" in row.read
    assert row.fix and list(found) == ["model", "megatron → hf names"]


def test_a_served_model_with_a_layer_the_trainer_lacks_is_never_sent(built: dict[str, list[Any]]) -> None:
    config = served_config(job_model("tiny"))
    row = c.coverage_row(built["tiny"], config | {"num_hidden_layers": config["num_hidden_layers"] + 1})
    assert row.outcome is Outcome.FAIL and "never sent: model.layers.2." in row.read and row.fix


def test_a_served_model_of_another_width_is_named_by_shape(built: dict[str, list[Any]]) -> None:
    config = served_config(job_model("tiny"))
    row = c.coverage_row(built["tiny"], config | {"intermediate_size": 2 * config["intermediate_size"]})
    assert row.outcome is Outcome.FAIL and "in another shape: model.layers.0.mlp.down_proj.weight" in row.read


def test_a_trainer_that_computes_otherwise_than_its_served_config_fails_as_each_rank_would(
    built: dict[str, list[Any]],
) -> None:
    other = dataclasses.replace(job_model("tiny"), rotary_base=500_000)
    row = c.served_row(built["tiny"], other)
    assert row.outcome is Outcome.FAIL and "rope_theta is 500000.0 there" in row.read and row.fix


def test_an_extra_left_out_of_the_backup_is_named_as_the_lifecycle_refuses_it(built: dict[str, list[Any]]) -> None:
    from orchestrator.adapters.megatron.trainer import Extra

    row = c.extras_row(built["cpu"])
    assert row.outcome is Outcome.OK and "1 expert_bias, 1 fp32, 1 frozen backed up" in row.read
    row = c.extras_row(built["cpu"], {Extra.EXPERT_BIAS, Extra.FROZEN})
    assert row.outcome is Outcome.FAIL
    assert "fp32_output_scale: not rebuilt from the fp32 mains and not an extra (a drop would lose it)" in row.read
    assert row.fix
