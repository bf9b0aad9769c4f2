"""`colocate run` as a user runs it: real Megatron-core ranks on Ray, a real transformers engine.

A run's start-up (a Ray cluster, three actors importing torch, Megatron and transformers) takes most
of a minute on a 2-core CI machine, so two runs serve every test here, one per mode. The
rematerialize run also exports its spans both ways a user asks for them: to a real OTLP/HTTP
receiver (OpenTelemetry's oteltest sink, named by the OTEL_* variables) and as OTLP/JSON under
--trace-dir. The driver, both rank actors and the engine actor export on their own, so each step's
trace is assembled from four processes: every parent must resolve, and every transition must be there.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import CYCLE, run
from tests.support.trace_check import edges, processes_per_trace

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
    return Runs({"rematerialize": rematerialize, "backup": _run(out, "backup")}, received, trace_file)


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
    assert set(report["steps"][0]["phase_seconds"]) == {
        "pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"
    }  # fmt: skip


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
