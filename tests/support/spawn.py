"""Rank processes for tests: started fresh, bounded, each writing its result as `rank<N>.json`."""

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


def context() -> mp.context.BaseContext:
    """Where rank processes come from. Without CUDA: a fork server of this test process that has
    imported torch, Megatron-core and transformers (tests/support/preload.py), so a rank starts in
    moments instead of after its own ~12 s of imports; each is still a process of its own, forked
    from a server that ran nothing else, with the environment the server started with (not this
    process's at the time: a rank is given what it needs as arguments). With CUDA: spawn, a fresh interpreter, since a process
    forked after Megatron's import may find CUDA already initialized in its parent."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.support.preload"])
    return ctx


def spawn_ranks(
    target: Callable[..., None], world_size: int, out: Path, *, args: tuple[Any, ...] = (), timeout: float = 240
) -> list[dict[str, Any]]:
    """Run `target(rank, world_size, port, out, *args)` in one new process per rank (`context()`).
    Every wait is bounded; a rank that wrote an `error` fails the call with its traceback."""
    ctx = context()
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
