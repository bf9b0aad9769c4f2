"""This host's memory as a run meets it: the cgroup's limit, `MemTotal`, RLIMIT_MEMLOCK and /dev/shm.

Everything is read from files under `root` (`/` by default), so that a test can hand a tree
that mimics `/proc` and `/sys/fs/cgroup`. What `job.preflight.Machine` reads (the memory
available now, the GPUs, the cores) is not read again here.

- The cgroup: the process's own, from `/proc/self/cgroup`. Under v1 the line naming the `memory`
  controller, its `memory.limit_in_bytes` under `/sys/fs/cgroup/memory`; otherwise v2's line
  `0::PATH`, its `memory.max` under `/sys/fs/cgroup` (or `/sys/fs/cgroup/unified`, where v1 and v2
  are mounted side by side). A limit binds the whole subtree, so the tightest of the cgroup and its
  ancestors is the process's. A folder the path names may be missing (a container that sees its
  own cgroup as its root): those levels are skipped.
- `MemTotal`, from `/proc/meminfo`. The cgroup's limit, where there is one, is taken over it, even
  when it is larger: some virtual machines grow `MemTotal` as memory is used, up to their limit.
- RLIMIT_MEMLOCK, this process's soft limit, from `/proc/self/limits` ("Max locked memory").
- /dev/shm's size and free bytes, by `statvfs`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# cgroup v1 writes "no limit" as LONG_MAX rounded down to a page (9223372036854771712 with 4 KiB
# pages); any value this large is no limit.
V1_NO_LIMIT = 1 << 62


@dataclass(frozen=True, kw_only=True, slots=True)
class HostMemory:
    """What `read` found; None where there is no limit, or nothing to read."""

    mem_total: int
    cgroup_limit: int | None = None  # the tightest memory limit over the cgroup and its ancestors
    cgroup_file: str | None = None  # the file it was read from, as the process names it
    memlock: int | None = None  # RLIMIT_MEMLOCK (soft), bytes; None: unlimited
    shm_size: int | None = None  # /dev/shm, bytes; None: no /dev/shm
    shm_free: int | None = None

    @property
    def limit(self) -> int:
        """What the process may hold in all: the cgroup's limit where it has one, else MemTotal."""
        return self.mem_total if self.cgroup_limit is None else self.cgroup_limit

    @property
    def limit_source(self) -> str:
        return "MemTotal (no cgroup limit)" if self.cgroup_file is None else f"the cgroup's {self.cgroup_file}"

    @classmethod
    def read(cls, root: Path = Path("/")) -> HostMemory:
        limit, where = cgroup_limit(root)
        shm = root / "dev/shm"
        size = free = None
        if shm.is_dir():
            stats = os.statvfs(shm)
            size, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
        return cls(
            mem_total=mem_total(root),
            cgroup_limit=limit,
            cgroup_file=where,
            memlock=memlock(root),
            shm_size=size,
            shm_free=free,
        )


def mem_total(root: Path) -> int:
    for line in (root / "proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            value, unit = line.split()[1:3]
            return int(value) * (1024 if unit == "kB" else 1)
    raise ValueError(f"{root / 'proc/meminfo'} has no MemTotal line")


def memlock(root: Path) -> int | None:
    """The soft RLIMIT_MEMLOCK of this process in bytes, None where unlimited."""
    for line in (root / "proc/self/limits").read_text().splitlines():
        if line.startswith("Max locked memory"):
            soft = line[len("Max locked memory") :].split()[0]
            return None if soft == "unlimited" else int(soft)
    return None


def _levels(path: str) -> list[str]:
    """`/a/b` → `a/b`, `a`, `` (the cgroup, then each ancestor up to the mount's root)."""
    pure = PurePosixPath("/", path)
    return [str(p.relative_to("/")) if p != PurePosixPath("/") else "" for p in (pure, *pure.parents)]


def _tightest(root: Path, mount: str, path: str, name: str) -> tuple[int | None, str | None]:
    """(bytes, the file as the process names it) of the lowest limit `name` over the cgroup at
    `path` and its ancestors, under `root/mount`."""
    found: tuple[int | None, str | None] = (None, None)
    for level in _levels(path):
        try:
            text = (root / mount / level / name).read_text().strip()
        except OSError:
            continue  # a level this process's view does not have
        if not text.isdigit() or int(text) >= V1_NO_LIMIT:  # "max" (v2), or v1's "no limit"
            continue
        if found[0] is None or int(text) < found[0]:
            found = (int(text), str(PurePosixPath("/", mount, level, name)))
    return found


def cgroup_limit(root: Path) -> tuple[int | None, str | None]:
    """(bytes, the file read) of the tightest memory limit over this process's cgroup and its
    ancestors, or (None, None) where none is set (or the process has no cgroup file)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    v1 = v2 = None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and not controllers:
            v2 = path
    if v1 is not None:
        return _tightest(root, "sys/fs/cgroup/memory", v1, "memory.limit_in_bytes")
    if v2 is not None:
        for mount in ("sys/fs/cgroup", "sys/fs/cgroup/unified"):
            if (root / mount / "cgroup.controllers").exists():
                limit = _tightest(root, mount, v2, "memory.max")
                if limit[0] is not None:
                    return limit
    return None, None
