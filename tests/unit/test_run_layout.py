"""`colocate run --tp --ep --pp`: the layout as the planner reads it, and every layout the ranks
cannot hold refused before anything starts, naming what the run has (`job.layout`)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.core.config import EngineKind
from orchestrator.errors import ConfigError
from orchestrator.job.checkpoint import identity
from orchestrator.job.config import Engine, RunConfig
from orchestrator.job.grpo import GRPOConfig, TaskConfig
from orchestrator.job.layout import describe, model_parallel

transformers = pytest.importorskip("transformers")


def moe() -> GRPOConfig:
    """A tiny Qwen3-MoE (4 experts, layer 1 MoE) as a user's config.json gives it."""
    from orchestrator.job.models import family_model

    config = transformers.Qwen3MoeConfig(
        vocab_size=160, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
    )  # fmt: skip
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = family_model(config.to_dict())
    return GRPOConfig(model=model, task=TaskConfig(vocab_size=model.vocab_size), prompts_per_step=6, group_size=4)


def problems(**fields: object) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        RunConfig(**fields)  # type: ignore[arg-type]
    return [str(v) for v in caught.value.violations]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            dict(ranks=3, tp=2),
            ["--ranks 3: 3 ranks do not split into groups of TP x PP = 2 x 1 (DP = ranks / (TP x PP) must be whole)"],
        ),
        (
            dict(ranks=4, tp=4),  # tiny: 4 heads in 2 query groups, a vocabulary of 10 ids
            [
                "--tp 4: query groups (KV heads) (2) do not divide by TP (4)",
                "--tp 4: the vocabulary (10 ids) does not divide by TP (4)",
            ],
        ),
        (dict(ranks=2, tp=0), ["--tp must be at least 1, got 0"]),
        (dict(ranks=2, ep=-1), ["--ep must be at least 1, got -1"]),
        (dict(ranks=2, ep=2), ["--ep 2: the model has no experts to split"]),
        (
            dict(ranks=2, pp=2),
            [
                "--pp 2: pipeline parallelism is not supported by colocate run yet (it needs Megatron's pipeline "
                "schedule); colocate_megatron supports it"
            ],
        ),
        (
            dict(ranks=2, tp=2, engine=Engine(kind=EngineKind.SGLANG, urls=("http://127.0.0.1:30000",))),
            [
                "--tp 2: --engine sglang takes data parallelism only in colocate run yet (its pushes do "
                "not gather shards); colocate_megatron syncs any layout to SGLang"
            ],
        ),
    ],
)
def test_a_layout_the_ranks_cannot_hold_is_refused_naming_it(fields: dict[str, object], expected: list[str]) -> None:
    assert problems(**fields) == expected


def test_an_moe_layout_is_refused_where_its_experts_do_not_split() -> None:
    grpo = moe()
    assert problems(grpo=grpo, ranks=3, ep=3) == ["--ep 3: routed experts (4) do not divide by EP (3)"]
    (tp,) = problems(grpo=grpo, ranks=2, tp=2)
    assert tp.startswith("--tp 2: ") and "need sequence parallelism" in tp and "--ep instead" in tp


def test_the_samples_of_a_step_split_over_data_parallel_groups_not_ranks() -> None:
    grpo = GRPOConfig(prompts_per_step=3, group_size=2)  # 6 samples: 3 per group of 2 TP ranks, not 6 / 4
    assert RunConfig(grpo=grpo, ranks=4, tp=2).layout.dp == 2
    assert problems(grpo=grpo, ranks=4) == ["the 6 samples of a step do not split evenly over 4 ranks"]
    assert problems(grpo=grpo, ranks=8, tp=2) == [
        "the 6 samples of a step do not split evenly over 4 data-parallel groups"
    ]


def test_the_layout_is_the_planners_with_tp_innermost() -> None:
    layout = RunConfig(ranks=4, tp=2).layout
    assert (layout.tp, layout.pp, layout.dp, layout.ep, layout.etp, layout.world) == (2, 1, 2, 1, 2, 4)
    assert describe(layout) == "TP 2 x DP 2" and model_parallel(layout)
    experts = RunConfig(grpo=moe(), ranks=2, ep=2).layout
    assert (experts.dp, experts.ep, experts.etp, experts.expert_dp) == (2, 2, 1, 1)  # each rank 2 whole experts
    assert describe(experts) == "DP 2, EP 2"
    assert not model_parallel(RunConfig(ranks=2).layout) and describe(RunConfig(ranks=2).layout) == "DP 2"


def test_a_checkpoint_of_one_layout_is_not_the_run_of_another() -> None:
    assert "layout" not in identity(RunConfig(ranks=2))  # as DP-only checkpoints saved before had it
    assert identity(RunConfig(ranks=2, tp=2))["layout"] == {"tp": 2, "pp": 1, "ep": 1}


def test_the_cli_refuses_it_with_exit_2_before_anything_starts() -> None:
    done = CliRunner().invoke(app, ["run", "--ranks", "3", "--tp", "2", "--pp", "2"])
    assert done.exit_code == 2
    text = " ".join(done.output.split())
    assert "--ranks 3: 3 ranks do not split into groups of TP x PP = 2 x 2" in text
    assert "--pp 2: pipeline parallelism is not supported by colocate run yet" in text
