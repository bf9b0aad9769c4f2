"""`colocate run` on a bad day, as a user would cause it: a rank actor killed or stopped by its
process id, Ctrl-C (during start-up too). The run names the rank at fault, ends within
--rank-timeout plus a few seconds, keeps its report, and leaves no Ray folder or process behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from orchestrator.job.interrupt import POLL_S
from orchestrator.job.workers.pool import PROBE_S
from tests.support import trace_check
from tests.support.faults import CLEANUP_S, Run, launcher, leftovers

psutil = pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# Small, so a hang test is quick. A stopped rank is named by the deadline of the call it hangs,
# RANK_TIMEOUT after the driver made it, and the probes after it (PROBE_S at most); a second
# unanswered call, the old behaviour, would take another RANK_TIMEOUT, past that bound.
RANK_TIMEOUT = 15.0
# Ctrl-C during start-up -> exit: every wait of the start-up looks at the request each POLL_S, and
# then the clean-up waits what it waits after a fault, CLEANUP_S at most (it was 23-47 s once).
STOPPED_WITHIN = POLL_S + CLEANUP_S


@pytest.fixture
def start(tmp_path: Path) -> Iterator[object]:
    with launcher(tmp_path, RANK_TIMEOUT) as launch:
        yield launch


def _await_rollout(run: Run) -> None:
    """Until the engine generates: the ranks are idle until it ends (once past the verified
    cycles, only a rollout keeps the engine busy)."""
    engine = psutil.Process(run.pid_of("EngineReplica(index=0)"))
    engine.cpu_percent()
    while engine.cpu_percent(interval=0.05) < 60:
        assert run.proc.poll() is None, run.finish()[1]


def _named_then_exited(run: Run, within: float = 120) -> tuple[float, bool, float, str]:
    """For a run that is to fail: when its report appeared (written once the run has named the
    rank at fault, before it stops anything), whether its Ray cluster's folder was still there
    then (the clean-up removes it last), when the run exited, and its stderr."""
    written, cluster_then, deadline = None, False, time.monotonic() + within
    while run.proc.poll() is None and time.monotonic() < deadline:
        if written is None and run.report.exists():
            written, cluster_then = time.monotonic(), any(run.temp.glob("colocate-ray-*"))
        time.sleep(0.01)
    exited, stderr = run.finish()
    return written or exited, cluster_then, exited, stderr


def _logged_at(line: dict[str, object]) -> float:
    return datetime.fromisoformat(str(line["timestamp"])).timestamp()


def test_a_rank_killed_during_a_rollout_is_named_at_once_and_the_report_written_first(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Also CI's trace check of a faulted run (tests/support/trace_check.py): one root per trace,
    every parent resolving, every promised attribute, no span naming a phase it never entered, the
    cause with its traceback, and every log line's ids naming its own transition's span."""
    # A rollout long enough (0.9 s here, 2.4 s on the AVX2 kernels, at 4x the default prompts)
    # that Ray has seen the death (in 10-14 ms here) before the engine's call ends; at the
    # default's 0.2 s the kill could land at its end, and the restore, the next call, name the rank
    # (red once). Not 8x: a train of 9 s on the AVX2 kernels came near RANK_TIMEOUT, and passed it.
    run = start("--trace-dir", str(tmp_path / "traces"), "--prompts", "512")
    run.wait_for_step(3)  # past the verified cycles
    victim, other = run.pid_of("TrainerRank(rank=1)"), run.pid_of("TrainerRank(rank=0)")
    _await_rollout(run)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    written, cluster_then, exited, stderr = _named_then_exited(run)
    print(f"kill -> report written: {written - killed:.2f} s, -> exit: {exited - killed:.1f} s")
    assert run.proc.returncode == 1, stderr
    assert "rollout failed in PARAMS_DROPPED: RankFailed: rank 1 (died) during engine.generate" in stderr, stderr
    assert "rank 0" not in stderr, stderr
    # What colocate knows, not Ray's guesses (the OOM killer, `ray stop --force`).
    assert f"its process (pid {victim}) ended without exiting: killed by a signal or crashed" in stderr, stderr
    assert "OOM" not in stderr and "ray stop" not in stderr, stderr
    assert "the lifecycle is FAULTED" in stderr, stderr
    (fault,) = [json.loads(line) for line in run.log.read_text().splitlines() if json.loads(line)["level"] == "error"]
    assert fault["event"] == "rollout" and "rank 1 (died)" in fault["cause"], fault  # not the restore after it
    # Named at once, by the sentinels: during the engine's call (the cause above), not at the next
    # call to the ranks, and sooner than any call's deadline (RANK_TIMEOUT). The report came before
    # the clean-up: the cluster's folder, which the clean-up removes last, was still there.
    assert written - killed < RANK_TIMEOUT
    assert cluster_then, "the report was written once the clean-up had removed the cluster's folder"
    assert exited - written < CLEANUP_S
    report = json.loads(run.report.read_text())
    assert "rank 1 (died)" in report["error"] and report["interrupted"] is False
    assert [s["step"] for s in report["steps"]][:3] == [1, 2, 3]
    assert leftovers(run, [victim, other]) == []
    (trace_file,) = (tmp_path / "traces").glob("*.otlp.jsonl")
    assert trace_check.problems(trace_file, run.log) == []
    spans = trace_check.read(trace_file)
    (fault,) = [s for s in spans if s.name == "lifecycle.fault"]
    assert "rank 1 (died)" in str(fault.attributes["colocate.cause"])
    (failed,) = [s for s in spans if s.error and s.name.startswith("lifecycle.") and s != fault]
    assert failed.name == "lifecycle.rollout" and failed.trace == fault.trace
    assert "colocate.destination" not in failed.attributes and fault.attributes["colocate.destination"] == "FAULTED"


def _await_training(run: Run, rank: int) -> None:
    """Until `rank` trains: once a rollout ended (the engine busy, then idle), the rank busy, and a
    moment more, past the restore (under 0.1 s here; the train takes 0.5 s or more). The log cannot
    tell: it is written in blocks."""
    _await_rollout(run)
    engine, busy = (
        psutil.Process(run.pid_of("EngineReplica(index=0)")),
        psutil.Process(run.pid_of(f"TrainerRank(rank={rank})")),
    )
    while engine.cpu_percent(interval=0.02) > 30:
        assert run.proc.poll() is None, run.finish()[1]
    busy.cpu_percent()
    while busy.cpu_percent(interval=0.02) < 60:
        assert run.proc.poll() is None, run.finish()[1]
    time.sleep(0.1)


def test_a_rank_killed_while_training_leaves_no_span_outliving_its_parent(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 0, in a collective with the rank killed, fails a moment after the driver learns of the
    death: the driver waits for its answer (`pool._settle`) before the failed train's span
    ends, so rank 0's `rank.train` ends inside it. Before, it ended after it (39.5 ms, once), or
    not before the close killed its process: no span at all."""
    run = start("--trace-dir", str(tmp_path / "traces"))
    run.wait_for_step(3)  # past the verified cycles
    victim = run.pid_of("TrainerRank(rank=1)")
    _await_training(run, 1)
    os.kill(victim, signal.SIGKILL)
    _, stderr = run.finish()
    assert run.proc.returncode == 1, stderr
    assert re.search(r"train failed in \w+: RankFailed: rank 1 \(died\)", stderr), stderr
    (trace_file,) = (tmp_path / "traces").glob("*.otlp.jsonl")
    assert trace_check.problems(trace_file, run.log) == []
    spans = trace_check.read(trace_file)
    (failed,) = [s for s in spans if s.name == "lifecycle.train" and s.error]
    trains = [s for s in spans if s.name == "rank.train" and s.parent == failed.id]
    assert [s.attributes["colocate.rank"] for s in trains] == [0], trains  # rank 0's ended, and was kept


def test_a_stopped_rank_is_named_within_the_timeout(start) -> None:  # type: ignore[no-untyped-def]
    run = start()
    run.wait_for_step(3)  # past the verified cycles
    victim, other = run.pid_of("TrainerRank(rank=1)"), run.pid_of("TrainerRank(rank=0)")
    _await_rollout(run)  # stopped now, it hangs the driver's first call to the ranks after the rollout
    try:
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        written, _, exited, stderr = _named_then_exited(run)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    lines = [json.loads(line) for line in run.log.read_text().splitlines()]
    at = next(i for i, line in enumerate(lines) if line["level"] == "error" or line["event"] == "fault")
    failed, rollout = lines[at], [line for line in lines[:at] if line["event"] == "rollout"][-1]
    named = _logged_at(failed) - _logged_at(rollout)
    print(f"stop -> report written: {written - stopped:.1f} s, -> exit: {exited - stopped:.1f} s; "
          f"rollout's end -> named: {named:.2f} s")  # fmt: skip
    assert run.proc.returncode == 1, stderr
    assert re.search(r"rank 1 \(no answer\) failed in \w+: TimeoutError: .*process is stopped", stderr), stderr
    assert "rank 0" not in stderr, stderr
    assert rollout["step"] == failed["step"], (rollout, failed)  # the rollout it was stopped in
    # The call made after that rollout fails at its deadline, RANK_TIMEOUT later, and is named by
    # the probes within PROBE_S (as soon as the others answer: a stopped process is not waited
    # for), which leaves the driver's few queries before the call the rest of that time. The
    # driver's log, which the two times come from, keeps them to the microsecond.
    assert RANK_TIMEOUT - 1e-6 <= named < RANK_TIMEOUT + PROBE_S
    assert exited - written < CLEANUP_S
    assert "rank 1 (no answer) failed in" in json.loads(run.report.read_text())["error"]
    assert leftovers(run, [other]) == []  # the stopped one was SIGKILLed here, in `finally`, if it had to be


def test_ctrl_c_keeps_the_steps_done_in_a_report_marked_interrupted(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    traces = tmp_path / "traces"
    run = start("--trace-dir", str(traces))
    run.wait_for_step(2)  # the step in flight finishes: 2 steps done, at least
    ranks = [run.pid_of(f"TrainerRank(rank={r})") for r in (0, 1)]
    run.proc.send_signal(signal.SIGINT)  # `kill -INT`: the driver only
    _, stderr = run.finish()
    assert run.proc.returncode == 130, stderr
    assert re.search(r"interrupted after \d+ of 500 step\(s\); the report keeps them in", stderr), stderr
    assert "Traceback" not in stderr, stderr
    report = json.loads(run.report.read_text())
    assert report["interrupted"] is True and report["error"] is None
    done = [s for s in report["steps"] if s["loss"] is not None]
    assert len(done) >= 2 and [s["step"] for s in done] == list(range(1, len(done) + 1))
    (trace_file,) = traces.glob("*.otlp.jsonl")  # the spans were flushed and merged
    steps = trace_file.read_text().count('"name":"colocate.step"')
    assert steps >= len(done)
    assert leftovers(run, ranks) == []


@pytest.mark.parametrize("moment", ["ray start, to the process group", "a rank's construction, to the driver"])
def test_ctrl_c_during_start_up_ends_the_run_at_once_and_leaves_nothing(start, moment: str) -> None:  # type: ignore[no-untyped-def]
    run = start()
    held = None
    if moment.startswith("ray start"):  # its Ray Client server is up: the one process that outlived the rest
        run.wait_for(lambda: run.running("ray.util.client.server"), "Ray Client's server")
        os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: `ray start` would get it too
    else:  # a rank held mid-construction: the start-up would not end by itself within 300 s
        held = run.wait_for(lambda: run.running("ray::TrainerRank.__init__"), "a rank's construction")[0]
        os.kill(held, signal.SIGSTOP)
        run.proc.send_signal(signal.SIGINT)
    asked = time.monotonic()
    try:
        exited, stderr = run.finish()
        left = run.processes()
    finally:
        if held is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held, signal.SIGKILL)
    print(f"Ctrl-C -> exit: {exited - asked:.1f} s")
    assert run.proc.returncode == 130, stderr
    assert "interrupted after 0 of 500 step(s)" in stderr and "error:" not in stderr, stderr
    assert left == {} and list(run.temp.glob("colocate-ray-*")) == [], left
    assert exited - asked < STOPPED_WITHIN
    assert json.loads(run.report.read_text())["interrupted"] is True
