"""The trace of a run with one fault, checked whole (tests/support/trace_check.py): a 2-rank run,
rank 1 killed during step 2 with `kill -9`.

Every trace has one root and every parent resolves; every span carries what the README promises;
no span names a destination its event did not enter; the failed action and the fault carry the
cause with its traceback; every log line's ids name its own transition's span.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import trace_check
from tests.support.faults import launcher

pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("psutil")

pytestmark = pytest.mark.slow


@pytest.fixture
def faulted(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    with launcher(tmp_path, rank_timeout=30.0) as launch:
        run = launch("--trace-dir", str(tmp_path / "traces"))  # type: ignore[operator]
        run.wait_for_step(2)
        os.kill(run.pid_of("TrainerRank(rank=1)"), signal.SIGKILL)
        _, stderr = run.finish()
        assert run.proc.returncode == 1, stderr
        (trace_file,) = (tmp_path / "traces").glob("*.otlp.jsonl")
        yield trace_file, run.log


def test_the_trace_of_a_faulted_run_keeps_every_promise(faulted: tuple[Path, Path]) -> None:
    trace_file, log = faulted
    assert trace_check.problems(trace_file, log) == []
    spans = trace_check.read(trace_file)
    names = [s.name for s in spans]
    assert names.count("colocate.start") == 1 and names.count("colocate.step") >= 2
    (fault,) = [s for s in spans if s.name == "lifecycle.fault"]
    assert "rank 1" in str(fault.attributes["colocate.cause"])
    failed = [s for s in spans if s.error and s.name.startswith("lifecycle.") and s.name != "lifecycle.fault"]
    assert len(failed) == 1 and failed[0].trace == fault.trace, "the failed action, in the step it ended"
    assert "colocate.destination" not in failed[0].attributes and fault.attributes["colocate.destination"] == "FAULTED"
