"""`colocate run --device cuda --ranks 2` on two GPUs: a rank and an engine replica per GPU.

The run learns, each replica receives its rank's weights by CUDA IPC (the engine's digests match
the trainer's), the lifecycle's memory order holds on each GPU as `cudaMemGetInfo` sees it, one
trace per step spans both ranks and both replicas, and a killed rank is named within the bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.job.presets import grpo_config
from orchestrator.telemetry.tracing import parse_otlp_json
from tests.support.cli import CYCLE, ROOT, colocate
from tests.support.faults import CLEANUP_S
from tests.support.rewards import reward_rise, rise_needed
from tests.support.trace_check import whole

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
STEPS = 20
RANK_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    pytest.importorskip("torch_memory_saver")
    pytest.importorskip("ray")
    out = tmp_path_factory.mktemp("run")
    done = subprocess.run(
        colocate("run", "--device", "cuda", "--ranks", "2", "--steps", str(STEPS),
                 "--report", str(out / "report.json"), "--trace-dir", str(out / "traces")),
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (trace,) = (out / "traces").glob("*.otlp.jsonl")
    return json.loads((out / "report.json").read_text()), trace


def test_two_gpu_run_learns_and_every_replica_holds_the_trained_weights(finished: tuple[dict, Path]) -> None:
    report, _ = finished
    steps = report["steps"]
    assert len(steps) == STEPS and all(s["phases"] == CYCLE for s in steps)
    assert [s["restore_verified"] for s in steps[:2]] == [True, True]
    assert report["engine_matches_trainer"] is True  # replica 0 = replica 1 = rank 0's converted weights
    # Learning: the last 3 steps' mean reward above the first 3's by more than 6 standard deviations
    # of what sampling alone moves it by (tests/support/rewards: 0.027 at --model tiny's 128 x 16 x 4
    # positions a step); a tiny run on two H200s rose 0.37 by step 20 (benchmarks/run_tiny.ranks2.h200x2.json).
    rewards = [s["reward_mean"] for s in steps]
    assert reward_rise(rewards, 3) > rise_needed(grpo_config("tiny"), 3), rewards


def test_memory_order_holds_on_each_gpu(finished: tuple[dict, Path]) -> None:
    """From step 2 (the caching allocator is warm): dropping the params frees memory on each
    GPU, and the replica's KV cache takes some back only after that."""
    report, _ = finished
    assert len(report["gpu_total_bytes"]) == 2
    for step in report["steps"][1:]:
        free = step["gpu_free_bytes"]
        for gpu in (0, 1):
            assert free["PARAMS_DROPPED"][gpu] > free["WEIGHTS_SYNCED"][gpu], (step["step"], gpu, free)
            assert free["ROLLOUT"][gpu] < free["PARAMS_DROPPED"][gpu], (step["step"], gpu, free)


def processes_per_trace(path: Path) -> dict[str, set[tuple[str, int | None]]]:
    """Per trace id, the (role, rank) of every process with a span in it."""
    seen: dict[str, set[tuple[str, int | None]]] = {}
    for line in path.read_text().splitlines():
        for resource in parse_otlp_json(line).resource_spans:
            where = {a.key: a.value for a in resource.resource.attributes}
            rank = where["colocate.rank"].int_value if "colocate.rank" in where else None
            process = (where["colocate.role"].string_value, rank)
            for scope in resource.scope_spans:
                for span in scope.spans:
                    if span.name == "colocate.step" or span.parent_span_id:
                        seen.setdefault(span.trace_id.hex(), set()).add(process)
    return seen


def test_every_step_is_one_trace_across_both_ranks_and_both_replicas(finished: tuple[dict, Path]) -> None:
    _, trace = finished
    full = {("driver", 0), ("rank", 0), ("rank", 1), ("engine", 0), ("engine", 1)}
    assert sum(1 for processes in processes_per_trace(trace).values() if processes == full) == STEPS


def test_every_span_is_in_a_step_the_start_up_or_the_close_and_ends_within_its_parent(
    finished: tuple[dict, Path],
) -> None:
    _, trace = finished
    assert whole(trace) == []


def _rank_process(temp: str, within: float = 300) -> int:
    """A rank actor's process of the run whose TMPDIR is `temp` (Ray's processes need not be the
    run's children: a detached `ray start` is not)."""
    import psutil

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline", "environ"]):
            with contextlib.suppress(psutil.Error):
                ours = (p.info["environ"] or {}).get("TMPDIR") == temp
                if ours and "TrainerRank" in " ".join(p.info["cmdline"] or []):  # Ray titles it by its class
                    return int(p.pid)
        time.sleep(0.5)
    raise AssertionError(f"no rank process within {within} s")


def test_a_killed_rank_is_named_within_the_bound(tmp_path: Path) -> None:
    pytest.importorskip("torch_memory_saver")
    report, log = tmp_path / "report.json", tmp_path / "log.jsonl"
    temp = tempfile.mkdtemp(prefix="cr-", dir="/tmp")  # short: Ray's socket paths must fit
    proc = subprocess.Popen(
        colocate("run", "--device", "cuda", "--ranks", "2", "--steps", "500",
                 "--rank-timeout", str(RANK_TIMEOUT), "--report", str(report), "--log", str(log)),
        cwd=ROOT, env={**os.environ, "TMPDIR": temp}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        victim = _rank_process(temp)
        deadline = time.monotonic() + 300
        while '"step": 2' not in (log.read_text() if log.exists() else ""):  # into the steps
            assert proc.poll() is None and time.monotonic() < deadline, "no second step started"
            time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        killed, written = time.monotonic(), None
        while proc.poll() is None and time.monotonic() < killed + RANK_TIMEOUT + CLEANUP_S + 60:
            if written is None and report.exists():  # once the rank is named, before the clean-up
                written = time.monotonic()
            time.sleep(0.01)
        _, stderr = proc.communicate(timeout=60)
        exited = time.monotonic()
        written = written or exited
    finally:
        proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
    print(f"kill -> report written: {written - killed:.2f} s, -> exit: {exited - killed:.1f} s")
    assert proc.returncode == 1, stderr
    named = re.findall(r"rank (\d) \(died\) failed in", stderr)
    assert len(set(named)) == 1 and "the lifecycle is FAULTED" in stderr, stderr
    # As tests/e2e/test_cli_faults.py bounds them: a death wakes whatever the driver waits on
    # (pool.Sentinels), so it is named sooner than any call's deadline (RANK_TIMEOUT), and from
    # then to the exit the run waits CLEANUP_S at most.
    assert written - killed < RANK_TIMEOUT
    assert exited - written < CLEANUP_S
    assert "(died) failed in" in json.loads(report.read_text())["error"]
