"""`colocate run` in the background, as a user starts it, for the tests that hurt it: kill or stop a
rank by its process id, send Ctrl-C, then read what the run left (its report, log, traces, and
any Ray folder or process)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from orchestrator.job.ray_reaper import STOP_S
from orchestrator.job.workers.placement import FLUSH_S
from tests.support.cli import ROOT, colocate

T = TypeVar("T")

# What a run waits for, at most, by its own settings, from naming a failed rank (its report is
# written then, before anything is stopped) to its exit: its workers' spans (FLUSH_S), then the
# private cluster's processes to be gone and its reaper to end (STOP_S each). The rest of the
# clean-up (ray.kill, ray.shutdown, the trace merge, the exit) waits on nothing and is allowed
# what those waits leave unused: a live worker flushes, and a killed process is gone, in moments.
CLEANUP_S = FLUSH_S + 2 * STOP_S


@dataclass
class Run:
    """A `colocate run --steps 500` in the background, with its own system temp folder."""

    proc: subprocess.Popen[str]
    temp: Path  # TMPDIR of the run: Ray's session folder goes here
    report: Path
    log: Path

    def wait_for_step(self, step: int, within: float = 240) -> None:
        """Until the transition log shows `step` under way."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.finish()[1]
            with contextlib.suppress(OSError):
                if any(json.loads(line).get("step", 0) >= step for line in self.log.read_text().splitlines()):
                    return
            time.sleep(0.2)
        raise AssertionError(f"step {step} did not start within {within} s")

    def wait_for(self, found: Callable[[], T], what: str, within: float = 240) -> T:
        """Until `found()` finds something (what it returns is true); returns it."""
        deadline = time.monotonic() + within
        while not (value := found()):
            assert self.proc.poll() is None, self.finish()[1]
            assert time.monotonic() < deadline, f"{what} did not happen within {within} s"
            time.sleep(0.1)
        return value

    def processes(self) -> dict[int, str]:
        """The live processes this run started, its Ray cluster's too (all have its TMPDIR): pid →
        command line (Ray's workers show what they run: `ray::TrainerRank.__init__`)."""
        import psutil

        found = {}
        for proc in psutil.process_iter(["environ", "cmdline", "status"]):
            with contextlib.suppress(psutil.Error):
                ours = (proc.info["environ"] or {}).get("TMPDIR") == str(self.temp) and proc.pid != os.getpid()
                if ours and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = " ".join(proc.info["cmdline"] or [])[:120]
        return found

    def running(self, command: str) -> list[int]:
        return [pid for pid, line in self.processes().items() if command in line]

    def pid_of(self, actor: str) -> int:
        """The process of a Ray actor, by the name Ray writes into its worker log."""
        for log in self.temp.glob("colocate-ray-*/session_*/logs/worker-*.out"):
            with contextlib.suppress(OSError):
                if f":actor_name:{actor}\n" in log.read_text():
                    return int(log.stem.rsplit("-", 1)[1])
        raise AssertionError(f"no Ray worker log names {actor}")

    def finish(self, within: float = 120) -> tuple[float, str]:
        """Wait for the run to exit; returns when it exited (monotonic) and its stderr. A run still
        going after `within` is aborted, and fails the test with its Python stacks."""
        try:
            _, stderr = self.proc.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            _, stderr = self.proc.communicate(timeout=60)
            raise AssertionError(f"still running {within} s later:\n{stderr[-20000:]}") from None
        return time.monotonic(), " ".join(stderr.split())


@contextlib.contextmanager
def launcher(folder: Path, rank_timeout: float) -> Iterator[object]:
    """`launch(*args)` starts `colocate run --steps 500 --ranks 2` with a report and a log under
    `folder`, in a process group and a system temp folder of its own; on the way out, every run
    still going is killed and its temp folder removed."""
    runs: list[Run] = []

    def launch(*args: str) -> Run:
        temp = Path(tempfile.mkdtemp(prefix="cf-", dir="/tmp"))  # short: Ray's socket paths must fit
        report, log = folder / "report.json", folder / "log.jsonl"
        command = colocate(
            "run", "--steps", "500", "--ranks", "2", "--rank-timeout", str(rank_timeout),
            "--report", str(report), "--log", str(log), *args,
        )  # fmt: skip
        env = {**os.environ, "TMPDIR": str(temp), "PYTHONFAULTHANDLER": "1"}
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # a process group of its own, as a terminal gives a command
        )  # fmt: skip
        runs.append(Run(proc, temp, report, log))
        return runs[-1]

    try:
        yield launch
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.communicate()
            shutil.rmtree(run.temp, ignore_errors=True)


def leftovers(run: Run, pids: list[int]) -> list[str]:
    """Ray folders and actor processes the run left behind."""
    import psutil

    folders = [p.name for p in run.temp.glob("colocate-ray-*")]
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(f"pid {pid}")
    return folders + alive
