"""Checkpoint and resume as a user meets them, on 2 real Megatron ranks over gloo and a real
transformers engine.

A run that never stops is the reference. A second run is hurt twice: a rank is killed by SIGKILL
once its step-1 checkpoint is in place (the run ends, exit 1); the run resumed from it has its
driver killed by SIGKILL once its step-2 checkpoint is in place; a third run resumes from that and
finishes. Its final weights must be the reference's, SHA256 for SHA256, and its rewards the
reference's step for step. What cannot be resumed from (a damaged file, another model or mode, a
folder with nothing complete) is refused before anything starts, naming the file or the
difference, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run
from tests.support.faults import launcher

psutil = pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

STEPS = 3


def _report(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _rewards(report: dict[str, Any]) -> list[tuple[int, float]]:
    return [(s["step"], s["reward_mean"]) for s in report["steps"] if s["loss"] is not None]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("unbroken")
    done = run(
        "run", "--steps", str(STEPS), "--ranks", "2", "--save-every", "1", "--save-dir", str(out / "ck"),
        "--report", str(out / "report.json"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return _report(out / "report.json"), out / "ck"


def test_a_run_killed_twice_resumes_to_the_unbroken_runs_weights_and_rewards(
    unbroken: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    reference, _ = unbroken
    ck = tmp_path / "ck"
    saving = ("--steps", str(STEPS), "--save-every", "1", "--save-dir", str(ck))
    with launcher(tmp_path, 60.0) as launch:
        hurt = launch(*saving)
        hurt.wait_for(lambda: (ck / "step-000001").is_dir(), "the step-1 checkpoint")
        victim = hurt.running("TrainerRank")[-1]  # ray::TrainerRank.<method>: a rank's own process
        os.kill(victim, signal.SIGKILL)
        _, stderr = hurt.finish()
        assert hurt.proc.returncode == 1, stderr
        assert "the lifecycle is FAULTED" in stderr

        again = launch(*saving, "--resume", str(ck))
        again.wait_for(lambda: (ck / "step-000002").is_dir(), "the step-2 checkpoint")
        again.proc.send_signal(signal.SIGKILL)  # the driver, as the OOM killer would
        again.proc.communicate()

    report = tmp_path / "final.json"
    done = run("run", *saving, "--resume", str(ck), "--ranks", "2", "--report", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    final = _report(report)
    assert final["resumed"] == [f"step {n} from {ck / f'step-00000{n}'}" for n in (1, 2)]  # each resume, kept
    assert final["weights_sha256"] == reference["weights_sha256"]
    assert _rewards(final) == _rewards(reference)  # steps 1 and 2 from the checkpoint's report, 3 run again
    assert [s["weight_version"] for s in final["steps"]] == [1, 2, 3]  # the resume pushed version 2 + 1
    assert final["engine_matches_trainer"] is True


def test_the_reference_saved_a_complete_checkpoint_each_step(unbroken: tuple[dict[str, Any], Path]) -> None:
    report, ck = unbroken
    assert sorted(p.name for p in ck.iterdir()) == ["step-000001", "step-000002", "step-000003"]
    saves = [s["phase_seconds"].get("save") for s in report["steps"]]
    assert all(seconds is not None for seconds in saves[1:])  # step 1's report was written mid-save
    assert all(s["phase_bytes"]["save"] > 0 for s in report["steps"])
    state = json.loads((ck / "step-000003" / "colocate.json").read_text())
    assert (state["step"], state["weight_version"], state["ranks"]) == (3, 3, 2)


def _copy(ck: Path, into: Path) -> Path:
    shutil.copytree(ck, into)
    return into


def _refused(*args: str) -> str:
    done = run("run", "--steps", str(STEPS + 1), "--ranks", "2", *args, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "configuration problem" in done.stderr and "Traceback" not in done.stderr
    return " ".join(done.stderr.split())


def test_what_cannot_be_resumed_from_is_refused_before_anything_starts(
    unbroken: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    _, ck = unbroken
    truncated = _copy(ck, tmp_path / "truncated")
    shard = next((truncated / "step-000003" / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"{shard}: 100 bytes, the manifest says" in _refused("--resume", str(truncated))

    other = _refused("--resume", str(ck), "--mode", "backup", "--seed", "7")
    assert "mode: the checkpoint's run has 'rematerialize', this one 'backup'" in other
    assert "seed: the checkpoint's run has 0, this one 7" in other

    assert "nothing to resume from" in _refused("--resume", str(tmp_path / "empty"))
    done = _refused("--resume", str(ck), "--steps", "3")
    assert "the checkpoint is at step 3; --steps 3 leaves none to run" in done


def test_a_checkpoint_of_two_ranks_resumes_on_one(unbroken: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    """Megatron reshards the optimizer (saved dp_reshardable) from 2 data-parallel ranks to 1."""
    _, ck = unbroken
    resumable = _copy(ck, tmp_path / "ck")
    shutil.rmtree(resumable / "step-000003")
    report = tmp_path / "one.json"
    done = run("run", "--steps", "3", "--ranks", "1", "--resume", str(resumable), "--report", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = _report(report)
    assert resumed["resumed"] == [f"step 2 from {resumable / 'step-000002'}"]
    assert [s["step"] for s in resumed["steps"]] == [1, 2, 3]
    assert resumed["steps"][-1]["restore_verified"] is True and resumed["engine_matches_trainer"] is True
