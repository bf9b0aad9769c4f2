"""Checkpoints in the one-call embedding (`colocate_megatron(checkpoint=Checkpoint(save_dir=,
save_every=, resume=))`), on real megatron-core at DP=2 over gloo and a real transformers engine (tests/support/checkpoint_ranks.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from orchestrator import ConfigError
from orchestrator.adapters.megatron.checkpointing import MegatronCheckpointer
from tests.support.checkpoint_ranks import rank_main
from tests.support.spawn import spawn_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An unbroken DP=2 run of 4 steps saving every 2; then a fresh pair resuming its step 2
    (after refusing a damaged copy), and rank 0 alone resuming its step 4 at DP=1."""
    out = tmp_path_factory.mktemp("checkpoints")
    unbroken = spawn_ranks(rank_main, 2, out, args=("unbroken",))
    (out / "step4.json").write_text(json.dumps(unbroken[0]["digests"]["4"]))
    for rank in range(2):
        (out / f"rank{rank}.json").unlink()
    resumed = spawn_ranks(rank_main, 2, out, args=("resumed",))
    return {"unbroken": unbroken, "resumed": resumed, "out": out}


def test_a_resumed_run_ends_bit_identical_to_the_unbroken_one(runs: dict[str, Any]) -> None:
    """Params, fp32 mains, Adam moments and steps of every rank after steps 3-4 trained again from
    step 2's checkpoint equal the unbroken run's; the first sync pushes the saved version + 1."""
    for rank, (unbroken, resumed) in enumerate(zip(runs["unbroken"], runs["resumed"], strict=True)):
        assert unbroken["versions"] == [1, 2, 3, 4]
        assert unbroken["saved"] == ["step-000002", "step-000004"]
        point = resumed["point"]
        assert (point["step"], point["weight_version"], point["resharded"]) == (2, 2, False), point
        assert point["state"] == {"next_step": 3}, "the trainer's own state, saved beside"
        assert resumed["versions"] == [3, 4], "the engine reports saved version + 1 after the first sync"
        differ = sorted(n for n, d in unbroken["digests"]["4"].items() if resumed["digests"].get(n) != d)
        assert resumed["digests"].keys() == unbroken["digests"]["4"].keys() and not differ, (rank, differ)
    saved = json.loads((runs["out"] / "resume" / "step-000004" / "colocate.json").read_text())
    assert saved | {"layout": None} == {
        "step": 4,
        "weight_version": 4,
        "world_size": 2,
        "layout": None,
        "state": {"next_step": 5},
    }


def test_a_truncated_file_is_refused_on_every_rank_naming_it_with_the_model_untouched(
    runs: dict[str, Any],
) -> None:
    truncated = runs["resumed"][0]["truncated"]
    for rank in runs["resumed"]:
        assert rank["refused"] is not None and rank["refused"].startswith("CheckpointRefused"), rank["refused"]
        assert f"{truncated}: " in rank["refused"] and "(truncated or overwritten)" in rank["refused"]
        assert rank["untouched"]


def test_a_save_that_fails_on_rank_0_raises_on_every_rank(runs: dict[str, Any]) -> None:
    """Rank 0 cannot make the partial directory: it raises its own error, rank 1 CheckpointFailed
    naming it, and neither waits on the other."""
    first, second = (rank["save_failed"] for rank in runs["resumed"])
    assert first is not None and first.startswith(("FileExistsError", "NotADirectoryError")), first
    assert second is not None and second.startswith("CheckpointFailed: making "), second
    assert "failed on rank 0: " + first in second, (first, second)


def test_a_dp2_checkpoint_resumes_at_dp1_resharded(runs: dict[str, Any]) -> None:
    """Rank 0 alone loads the DP=2 run's step 4: the params are the ones saved, and it trains on."""
    one = runs["resumed"][0]["one_rank"]
    assert (one["step"], one["resharded"]) == (4, True)
    assert one["params_equal"]
    assert one["trained"]


def test_another_models_checkpoint_is_refused_naming_it_and_megatrons_message(runs: dict[str, Any]) -> None:
    refused = runs["resumed"][0]["one_rank"]["another_model"]
    step4 = runs["out"] / "ckpt" / "step-000004"
    assert refused is not None and refused.startswith("CheckpointRefused"), refused
    assert f"{step4}: does not fit this model (Megatron: " in refused, refused


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"save_every": 2}, "save_every=2 needs save_dir"),
        ({"save_every": -1, "save_dir": "/tmp/x"}, "save_every must be a whole number of steps, 0 or more"),
    ],
)
def test_save_every_without_save_dir_or_below_zero_is_refused_naming_it(kwargs: dict[str, Any], problem: str) -> None:
    """What `colocate_megatron` builds from its checkpoint's `save_every`, `save_dir`: refused before anything."""
    every, save_dir = kwargs["save_every"], kwargs.get("save_dir")
    with pytest.raises(ConfigError, match=problem):
        MegatronCheckpointer([], None, save_dir=save_dir, every=every)
