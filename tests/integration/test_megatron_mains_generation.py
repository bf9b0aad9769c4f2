"""`MegatronTrainer.mains_generation` and a rebuild after a step that raised midway, on real
megatron-core DDP + DistributedOptimizer (one gloo rank, spawned: tests/support/megatron_ranks.py).

The model has the extras: an expert_bias buffer (changed by each step's `finalize_model_grads`),
an fp32 param (its main is itself, so the inner Adam step changes it) and a frozen param.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.support.megatron_ranks import EXPERT_BIAS, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # one spawn: megatron's import, a tiny MoE GPT


@pytest.fixture(scope="module")
def rank(tmp_path_factory: pytest.TempPathFactory) -> dict:
    (result,) = run_ranks("steps", 1, tmp_path_factory.mktemp("steps"), timeout=200)
    return result


def test_each_optimizer_step_moves_the_generation_by_one(rank: dict) -> None:
    assert rank["generations"] == [0, 1, 2]


def test_the_count_is_the_trainers_own(rank: dict) -> None:
    """A second trainer over the same optimizer counts from its construction: hooks per instance."""
    assert rank["later_trainer"] == 0
    assert rank["later_trainer_after"] == 2, "it saw the two steps that raised"


@pytest.mark.parametrize("mode", ["rematerialize", "backup"])
def test_a_step_that_raised_after_moving_the_mains_counts_and_rebuild_casts_them(rank: dict, mode: str) -> None:
    """protocols.TrainerControl.rebuild: the stash is older than the step, so the params are cast
    from the mains whatever the mode (backup mode's stashed params would be the old ones), and the
    extras the step changed are left as it left them, not reverted to the stash."""
    step = rank[mode]
    assert step["raised"] == "injected: the cast after the inner step"
    assert step["moved"] == 1, "the step that raised midway counts"
    assert step["off_before_rebuild"] > 0, "the mains moved and the params did not: nothing to prove otherwise"
    assert step["off_after_rebuild"] == [], "params not cast(mains) after the rebuild"
    assert {"fp32_output_scale", EXPERT_BIAS} <= set(step["extras_the_step_changed"])
    assert step["extras_the_rebuild_changed"] == [], "the rebuild copied a stale stash over live extras"
