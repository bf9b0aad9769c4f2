"""The private Ray cluster's processes (`ray_cluster.start_private`): found by the mark each
inherits, and stopped with the run or, however the run went (`kill -9` too), by the reaper it
leaves behind. `ray start` detaches them, so nothing else would.

Each is stopped by its process, never by a name: other Ray clusters on the machine are left alone.
psutil is imported inside the functions, as ray is in `ray_cluster`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STOP_S = 5.0  # how long the private cluster's processes, once killed, may take to be gone
# In the environment of `ray start`, and so of every process the private cluster starts: its folder.
MARK = "COLOCATE_RAY_CLUSTER"


def head_processes(temp_dir: Path) -> list[Any]:
    """Every process of the private cluster at `temp_dir` (psutil.Process), and their
    descendants: those whose environment names that folder (unique to the run) as `MARK`, which
    each inherits from `ray start`, and those with the folder or the cluster's GCS address on
    their command line (a cluster started otherwise, as by a test: Ray Client's server has only
    the address there, and the address is written only once `ray start` is done)."""
    import psutil

    marks = [str(temp_dir)]
    with contextlib.suppress(OSError):
        marks.append(f"={(temp_dir / 'ray_current_cluster').read_text().strip()} ")  # 127.0.0.1:PORT
    found: dict[int, Any] = {}
    for proc in psutil.process_iter(["cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(proc.info["cmdline"] or []) + " "
            if (proc.info["environ"] or {}).get(MARK) == str(temp_dir) or any(mark in line for mark in marks):
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
    found.pop(os.getpid(), None)
    return list(found.values())


def start_reaper(temp_dir: Path) -> subprocess.Popen[bytes]:
    """A process that stops the cluster at `temp_dir` once this one is gone, however it went
    (`kill -9` too): it waits for the end of a pipe only this process holds. `ray start` detaches
    the cluster's processes, so nothing else would. Its own session: a Ctrl-C to the terminal's
    process group does not end it before it has done its work."""
    command = [sys.executable, "-m", "orchestrator.job.ray_reaper"]
    reaper = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
    if reaper.stdin is not None:  # the folder goes by the pipe: on its command line, `head_processes` would count it
        reaper.stdin.write(f"{temp_dir}\n".encode())
        reaper.stdin.flush()
    return reaper


def stop_reaper(reaper: subprocess.Popen[bytes], temp_dir: Path) -> None:
    """Stop the cluster here, then let the reaper go (it finds nothing left to stop)."""
    try:
        _stop_head(temp_dir)
    finally:
        if reaper.stdin is not None:
            reaper.stdin.close()
        try:
            reaper.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()


def _stop_head(temp_dir: Path) -> None:
    """Stop the private cluster's processes (by process, never by name: other Ray clusters on
    the machine are left alone) and remove its folder."""
    import psutil

    try:
        procs = head_processes(temp_dir)
        # SIGKILL at once: nothing of a private cluster outlives the run, so there is nothing to
        # flush, and a stopped process (SIGSTOP) would hold SIGTERM until it is continued.
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        # Until each is dead: gone, or a zombie, which holds nothing but its entry in the process
        # table until its parent (or, the raylet killed, the init process) reaps it, which on a
        # container's init can take seconds.
        deadline = time.monotonic() + STOP_S
        while any(_alive(proc) for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _alive(proc: Any) -> bool:
    import psutil

    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:  # gone (or, unreadable, not ours to wait for)
        return False


if __name__ == "__main__":  # the reaper (`start_reaper`)
    folder = Path(sys.stdin.buffer.readline().decode().strip())
    sys.stdin.buffer.read()  # returns once the driver's end of the pipe is closed
    _stop_head(folder)
