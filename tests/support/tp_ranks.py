"""Trainer ranks without Megatron, for the SGLang push's contract tests (tests/contracts/test_sglang_tp_payloads.py).

`GivenWeightsRank` is a `TrainerRank` whose converted weights are given tensors, the same on every
rank as data-parallel ranks hold them: its side of a push (`push_weights`, `PayloadSource`) is
the real one. `rank_processes` runs each in a process of its own, as Ray runs a job's ranks, so a
payload's shared memory is that process's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.managers import BaseManager

from orchestrator.job.workers.pool import WorkerPool
from orchestrator.job.workers.trainer_rank import TrainerRank
from orchestrator.protocols import Named
from tests.support.sglang_weights import tensors
from tests.support.spawn import context


class GivenWeightsRank(TrainerRank):
    """A `TrainerRank` whose `converted()` yields `named` (default: `sglang_weights.tensors()`):
    no model, no process group; only its weight pushes are meant to be called."""

    def __init__(self, rank: int, named: Sequence[Named] | None = None, device: str = "cpu") -> None:
        self.rank = rank
        self.named = list(tensors() if named is None else named)
        if device == "cuda":  # rank r on GPU r (of those visible), as a job's ranks are placed
            import torch

            index = rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.named = [(name, t.to(f"cuda:{index}")) for name, t in self.named]

    def converted(self) -> Iterator[Named]:
        yield from self.named


class _Host(BaseManager):
    """A process holding one rank; its proxy forwards `invoke`, the one method `WorkerPool` calls."""


_Host.register("Rank", GivenWeightsRank, exposed=("invoke",))


@contextlib.contextmanager
def rank_processes(count: int, device: str = "cpu") -> Iterator[WorkerPool[TrainerRank]]:
    """`count` `GivenWeightsRank`s, rank r in a process of its own (its weights on `device`), as a pool the driver calls.
    The pool holds proxies (`remote=False`: each call returns once the rank's process answered);
    `pids` holds each rank's process id."""
    hosts = [_Host(ctx=context()) for _ in range(count)]
    started: list[_Host] = []
    ranks: WorkerPool[TrainerRank] = WorkerPool([], label="rank", remote=False)
    try:
        with ThreadPoolExecutor(count) as pool:  # each start waits out its process's imports: all at once
            for host in pool.map(_start, hosts):
                started.append(host)
        ranks.workers = [host.Rank(rank, device=device) for rank, host in enumerate(hosts)]  # type: ignore[attr-defined]
        ranks.start()
        yield ranks
    finally:
        ranks.workers.clear()  # the proxies first: a host none refers to stops sooner
        with ThreadPoolExecutor(count) as pool:  # each waits up to 1 s for its process to end: all at once
            list(pool.map(_shutdown, started))


def _start(host: _Host) -> _Host:
    host.start()
    return host


def _shutdown(host: _Host) -> None:
    host.shutdown()  # type: ignore[attr-defined]
