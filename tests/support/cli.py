"""Running the `colocate` command as a user does: the installed script, or `python -m` without one."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CYCLE = ["TRAIN", "GRADS_PAUSED", "WEIGHTS_SYNCED", "PARAMS_DROPPED", "ROLLOUT", "TRAIN"]


def colocate(*args: str) -> list[str]:
    exe = shutil.which("colocate")
    return [exe, *args] if exe else [sys.executable, "-m", "orchestrator.cli", *args]


def run(*args: str, timeout: float = 300, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(colocate(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def sglang_stand_ins(
    folder: Path,
    count: int = 1,
    device: str = "cpu",
    join_groups: bool = False,
    changed: Sequence[Sequence[str]] = (),
) -> Iterator[list[str]]:
    """Servers speaking SGLang's HTTP API, started as docs/sglang.md starts SGLang: `colocate
    engine-config FOLDER`, then one server per URL loading it (tests/support/sglang_server.py).
    `changed[i]`: more arguments of server i (a later `--model-path` replaces the folder)."""
    done = run("engine-config", str(folder))
    assert done.returncode == 0, done.stderr
    command = [sys.executable, "-m", "tests.support.sglang_server", "--model-path", str(folder), "--device", device]
    command += ["--join-groups"] if join_groups else []
    extra = [list(changed[i]) if i < len(changed) else [] for i in range(count)]
    procs = [subprocess.Popen(command + e, cwd=ROOT, stdout=subprocess.PIPE, text=True) for e in extra]
    try:
        urls = [p.stdout.readline().strip() if p.stdout is not None else "" for p in procs]
        assert all(u.startswith("http://") for u in urls), f"a stand-in server did not start: {urls}"
        yield urls
    finally:
        for p in procs:
            p.kill()
            p.wait()


def served_versions(url: str) -> list[list[tuple[str, str]]]:
    """A process stand-in's record (GET /_stand_in/state): per weight update, the version served
    after each of its requests, the update's /begin_weight_update first."""
    import requests

    updates: list[list[tuple[str, str]]] = []
    for route, version in requests.get(f"{url}/_stand_in/state", timeout=10).json()["versions"]:
        if route == "/begin_weight_update":
            updates.append([])
        updates[-1].append((route, version))
    return updates


def moved_once_at_the_end(update: list[tuple[str, str]]) -> bool:
    """True where the version served stayed the old one up to the session's close and moved only
    by the /update_weight_version after it."""
    *before, (last_route, new) = update
    return last_route == "/update_weight_version" and len({v for _, v in before}) == 1 and before[0][1] != new
