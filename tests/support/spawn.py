"""Rank processes for tests: spawned, bounded, each writing its result as `rank<N>.json`."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    target: Callable[..., None], world_size: int, out: Path, *, args: tuple[Any, ...] = (), timeout: float = 240
) -> list[dict[str, Any]]:
    """Run `target(rank, world_size, port, out, *args)` in one spawned process per rank. Every wait
    is bounded; a rank that wrote an `error` fails the call with its traceback."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, str(out), *args)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            raise TimeoutError(f"rank process {p.pid} ({target.__name__}) did not finish in {timeout} s")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return results
