"""`colocate check` reads a real cgroup memory limit: a child of this process's own memory cgroup
is made with a limit, a process started in it reads it, and the child is removed.

Where this machine does not allow one (no write access to the cgroup file system, as on most CI
runners, or a v2 hierarchy whose controllers cannot be delegated), the test is skipped, and
tests/unit/test_check_memory.py's file trees that mimic /sys/fs/cgroup stand for it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.job.check.host import HostMemory
from tests.support.cli import ROOT

LIMIT = 1 << 30  # room for Python and the imports of the reading process


def own_cgroup() -> tuple[Path, str] | None:
    """(this process's memory cgroup folder, the limit file's name), v1 or v2."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory", path.lstrip("/")), "memory.limit_in_bytes"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            folder = Path("/sys/fs/cgroup", line[3:].lstrip("/"))
            if "memory" in (folder / "cgroup.subtree_control").read_text().split():
                return folder, "memory.max"
    return None


@contextlib.contextmanager
def limited_child() -> Iterator[Path]:
    found = own_cgroup()
    if found is None or not found[0].is_dir():
        pytest.skip("this process has no memory cgroup whose children get a memory limit")
    folder, name = found
    child = folder / f"colocate-check-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"this machine allows no child cgroup here ({exc.strerror}: {folder})")
    try:
        (child / name).write_text(str(LIMIT))
        yield child
    finally:
        child.rmdir()  # its one process has exited


def test_a_real_cgroup_limit_is_read() -> None:
    with limited_child() as child:
        code = "from orchestrator.job.check.host import HostMemory; h = HostMemory.read(); print(h.cgroup_limit, h.cgroup_file)"
        # The process joins the cgroup before Python starts: `exec` keeps its pid.
        script = f'echo $$ > {child}/cgroup.procs && exec {sys.executable} -c "{code}"'
        done = subprocess.run(["sh", "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
    limit, file = done.stdout.split()
    assert int(limit) == LIMIT
    assert file.endswith(f"{child.name}/{'memory.limit_in_bytes' if 'memory/' in str(child) else 'memory.max'}")
    assert HostMemory.read().cgroup_limit != LIMIT  # this process stays outside it
