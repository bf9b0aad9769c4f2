"""`colocate run` as a user runs it: real Megatron-core ranks on Ray, a real transformers engine.

A run's start-up (a Ray cluster, three actors importing torch, Megatron and transformers) takes most
of a minute on a 2-core CI machine, so two runs serve every test here, one per mode. The
rematerialize run also exports its spans both ways a user asks for them: to a real OTLP/HTTP
receiver (OpenTelemetry's oteltest sink, named by the OTEL_* variables) and as OTLP/JSON under
--trace-dir. The driver, both rank actors and the engine actor export on their own, so each step's
trace is assembled from four processes: every parent must resolve, and every transition must be there.

The backup run saves a checkpoint every step: it is the unbroken reference of the resume tests.
Another run is hurt twice: a rank is killed by SIGKILL once its step-1 checkpoint is in place (the
run ends, exit 1); the run resumed from it has its driver killed by SIGKILL once its step-2
checkpoint is in place; a third run resumes from that and finishes. Its final weights must be the
reference's, SHA256 for SHA256, and its rewards the reference's step for step. What cannot be
resumed from (a damaged file, another mode or seed, a folder with nothing complete) is refused
before anything starts, naming the file or the difference, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import CYCLE, run
from tests.support.faults import launcher
from tests.support.trace_check import edges, processes_per_trace, whole

pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("transformers")
pytest.importorskip("oteltest")

from tests.support.otlp_receiver import Collect, receiver

pytestmark = pytest.mark.slow

STEPS = 3
EVENTS = ["pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"]

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Runs:
    reports: dict[str, dict]  # mode → its --report
    received: Collect  # what the OTLP receiver got from the rematerialize run
    trace_file: Path  # and what it wrote under --trace-dir
    checkpoints: Path  # the backup run's --save-dir


def _run(out: Path, mode: str, *args: str, env: dict[str, str] | None = None) -> dict:
    path = out / f"{mode}.json"
    done = run("run", "--steps", str(STEPS), "--ranks", "2", "--mode", mode, "--report", str(path), *args, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine matches trainer" in done.stdout
    return dict(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("run")
    with receiver() as (received, endpoint):
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            # The service named only here, as OpenTelemetry lets a deployment name it.
            "OTEL_RESOURCE_ATTRIBUTES": "service.name=colocate-test,deployment.environment.name=ci%20run",
        }
        env.pop("OTEL_SERVICE_NAME", None)
        rematerialize = _run(out, "rematerialize", "--trace-dir", str(out / "traces"), env=env)
    (trace_file,) = (out / "traces").glob("*.otlp.jsonl")
    backup = _run(out, "backup", "--save-every", "1", "--save-dir", str(out / "ck"))
    return Runs({"rematerialize": rematerialize, "backup": backup}, received, trace_file, out / "ck")


@pytest.fixture(scope="module")
def reports(runs: Runs) -> dict[str, dict]:
    return runs.reports


@pytest.fixture(scope="module")
def spans(runs: Runs) -> list[dict[str, Any]]:
    return runs.received.spans


@pytest.mark.parametrize("mode", ["rematerialize", "backup"])
def test_every_step_walks_the_cycle_in_order(reports: dict[str, dict], mode: str) -> None:
    report = reports[mode]
    assert report["mode"] == mode and report["ranks"] == 2
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert all(s["phases"] == CYCLE for s in report["steps"])
    saved = {"save"} if mode == "backup" else set()  # a save ends each step, in TRAIN
    assert set(report["steps"][0]["phase_seconds"]) == {
        "pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"
    } | saved  # fmt: skip


@pytest.mark.parametrize("mode", ["rematerialize", "backup"])
def test_restores_verified_and_versions_increase(reports: dict[str, dict], mode: str) -> None:
    steps = reports[mode]["steps"]
    assert [s["restore_verified"] for s in steps] == [True, True, None]  # --verify-cycles 2
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(set(versions)) and versions[0] == 1
    assert reports[mode]["engine_matches_trainer"] is True


def test_rematerialize_pins_under_one_percent_of_backup(reports: dict[str, dict]) -> None:
    remat = reports["rematerialize"]["host_pinned_bytes_per_rank"]
    backup = reports["backup"]["host_pinned_bytes_per_rank"]
    assert backup >= reports["backup"]["param_bytes_bf16_per_rank"]
    assert remat <= 0.01 * backup


def test_bad_values_are_clear_errors() -> None:
    for args, words in (
        (("--steps", "0"), "--steps must be at least 1"),
        (("--ranks", "0"), "--ranks must be at least 1"),
        (("--mode", "lazy"), "'lazy' is not one of"),
        (("--report", "/nonexistent-dir/r.json"), "folder /nonexistent-dir does not exist"),
    ):
        done = run("run", *args, timeout=60)
        assert done.returncode != 0
        assert words in " ".join(done.stderr.split()), done.stderr


# The OTLP receiver's view of the rematerialize run.


def test_every_process_exported(spans: list[dict[str, Any]]) -> None:
    assert {(s["role"], s["rank"]) for s in spans} == {("driver", 0), ("rank", 0), ("rank", 1), ("engine", None)}


def test_every_process_takes_its_service_from_the_resource_attributes(runs: Runs) -> None:
    """OpenTelemetry's order: OTEL_SERVICE_NAME (unset here), then OTEL_RESOURCE_ATTRIBUTES."""
    assert runs.received.services == {(role, "colocate-test", "ci run") for role in ("driver", "rank", "engine")}


def test_each_step_is_one_trace_with_every_transition(spans: list[dict[str, Any]]) -> None:
    steps = [s for s in spans if s["name"] == "colocate.step"]
    assert len(steps) == STEPS
    for step in steps:
        in_trace = [s for s in spans if s["trace"] == step["trace"]]
        names = Counter(s["name"] for s in in_trace)
        assert all(names[f"lifecycle.{e}"] == 1 for e in EVENTS), names
        assert {s["role"] for s in in_trace} == {"driver", "rank", "engine"}
        assert {s["rank"] for s in in_trace if s["role"] == "rank"} == {0, 1}


def test_parents_resolve_across_processes(spans: list[dict[str, Any]]) -> None:
    ids = {(s["trace"], s["id"]) for s in spans}
    for s in spans:
        if s["parent"]:
            assert (s["trace"], s["parent"]) in ids, s
    by_id = {s["id"]: s for s in spans}
    rebuild = [s for s in spans if s["name"] == "rank.rebuild"]
    assert rebuild and all(by_id[s["parent"]]["name"] == "lifecycle.restore" for s in rebuild)
    cast = [s for s in spans if s["name"] == "rank.cast"]
    assert cast and all(by_id[s["parent"]]["name"] == "rank.rebuild" for s in cast)


def test_attributes_are_set(spans: list[dict[str, Any]]) -> None:
    update = next(s for s in spans if s["name"] == "lifecycle.update_weights")
    a = update["attributes"]
    assert a["colocate.source"].string_value == "GRADS_PAUSED"
    assert a["colocate.destination"].string_value == "WEIGHTS_SYNCED"
    assert a["colocate.bytes_moved"].int_value > 0
    pause = next(s for s in spans if s["name"] == "rank.pause")
    assert pause["attributes"]["colocate.memory_before"].int_value > 0
    assert "colocate.memory_after" in pause["attributes"]


# Its --trace-dir file, parsed through the official mapping, and read back by `colocate trace`.


def test_every_step_is_one_trace_across_ranks_and_engine_in_the_trace_file(runs: Runs) -> None:
    full = {("driver", 0), ("rank", 0), ("rank", 1), ("engine", None)}
    assert list(processes_per_trace(runs.trace_file).values()) == [full] * STEPS


def test_every_span_is_in_a_step_the_start_up_or_the_close_and_ends_within_its_parent(runs: Runs) -> None:
    assert whole(runs.trace_file) == []


def test_summarize_and_timeline_read_the_trace_file(runs: Runs, tmp_path: Path) -> None:
    summary = run("trace", "summarize", str(runs.trace_file))
    assert summary.returncode == 0, summary.stderr
    assert "update_weights" in summary.stdout and f"{STEPS} step(s)" in summary.stdout
    picture = tmp_path / "step.svg"
    drawn = run("trace", "timeline", str(runs.trace_file), "--output", str(picture))
    assert drawn.returncode == 0, drawn.stderr
    assert picture.read_text().lstrip().startswith("<?xml")


def test_the_committed_sample_has_the_span_tree_of_this_run(runs: Runs) -> None:
    """docs/tracing.md's tree is the committed sample's (tests/docs); this keeps the sample a run's of today."""
    sample, fresh = edges(ROOT / "traces" / "sample.otlp.jsonl"), edges(runs.trace_file)
    assert fresh - sample == set(), f"this run has parent-child pairs the sample lacks: {sorted(fresh - sample)}"
    assert sample - fresh == set(), f"the sample has parent-child pairs this run lacks: {sorted(sample - fresh)}"


# ---- checkpoints and resume (the backup run is the unbroken reference) -------------------------


def _report(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _rewards(report: dict[str, Any]) -> list[tuple[int, float]]:
    return [(s["step"], s["reward_mean"]) for s in report["steps"] if s["loss"] is not None]


@pytest.fixture(scope="module")
def unbroken(runs: Runs) -> tuple[dict[str, Any], Path]:
    return runs.reports["backup"], runs.checkpoints


def test_a_run_killed_twice_resumes_to_the_unbroken_runs_weights_and_rewards(
    unbroken: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    reference, _ = unbroken
    ck = tmp_path / "ck"
    saving = ("--steps", str(STEPS), "--mode", "backup", "--save-every", "1", "--save-dir", str(ck))
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
    assert f"{shard}: 100 bytes, the manifest says" in _refused("--resume", str(truncated), "--mode", "backup")

    other = _refused("--resume", str(ck), "--mode", "rematerialize", "--seed", "7")
    assert "mode: the checkpoint's run has 'backup', this one 'rematerialize'" in other
    assert "seed: the checkpoint's run has 0, this one 7" in other

    assert "nothing to resume from" in _refused("--resume", str(tmp_path / "empty"), "--mode", "backup")
    done = _refused("--resume", str(ck), "--mode", "backup", "--steps", "3")
    assert "the checkpoint is at step 3; --steps 3 leaves none to run" in done
