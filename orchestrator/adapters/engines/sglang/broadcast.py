"""Servers off the trainer's GPUs: weights by NCCL broadcast over a weight-update group."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, TypeVar

import torch

from orchestrator.adapters.engines.sglang.client import SGLangEngine
from orchestrator.adapters.engines.sglang.weights import _destroy_group_quietly
from orchestrator.adapters.engines.sglang.wire import flattened_bucket
from orchestrator.errors import EngineError
from orchestrator.protocols import Named
from orchestrator.telemetry.logs import note_leftover
from orchestrator.telemetry.tracing import carried

T = TypeVar("T")


def weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> Any:
    """A process group beside the default one, made as SGLang's `init_custom_process_group`
    (sglang/srt/utils/common.py) makes it, since both ends must take the same steps: a TCP
    rendezvous hosted by rank 0, a `PrefixStore(group_name)`, then torch's (private)
    `_new_process_group_helper`, whose group ranks are the world ranks."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    name: Any = group_name  # a str; torch 2.13 types it as its GroupName NewType, 2.11 lacks that
    group, _ = _new_process_group_helper(
        world_size, rank, [], backend, PrefixStore(group_name, store), group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class WeightBroadcaster:
    """The trainer's end of SGLang's weight-update group, for servers off the trainer's GPUs.

    This process is rank 0; each server's TP ranks follow (`rank_offset` 1, 1 + tp, ...). The
    servers join by /init_weights_update_group while this process hosts the rendezvous. Each
    bucket is announced by /update_weights_from_distributed while this process broadcasts it as
    one flattened uint8 tensor; SGLang answers once it has received it.

    Start-up:
    - A group of `group_name` that a server still holds (left by a run that was killed) is
      destroyed first, with a `leftover` warning line: SGLang refuses to make a group under a
      name it has.
    - A server that refuses to join fails the start at once, with SGLang's answer; the group is
      not waited for (its rendezvous would wait `timeout_s` for the server that will never come).
      The servers that had joined are left waiting in their own rendezvous until their timeout.

    A server that refuses an announcement never receives. The broadcast is started
    asynchronously, so the refusal is raised at once (an `EngineError` naming the server); the
    group is aborted, which cancels NCCL's pending work, while gloo's ends at the group's
    `timeout_s` (this process may wait that long to exit). The broadcaster then refuses any
    further use: the group is out of step.

    `close()` destroys the group on every server and here, whatever state it is in.
    """

    def __init__(
        self,
        engines: Sequence[SGLangEngine],
        *,
        master_port: int,
        master_address: str = "127.0.0.1",
        backend: str = "nccl",
        group_name: str = "colocate_weights",
        timeout_s: float = 300.0,
    ) -> None:
        self.engines, self.group_name = list(engines), group_name
        self._broken: str | None = None
        self._group: Any = None
        for engine in self.engines:
            if engine.destroy_weights_update_group(group_name):
                note_leftover(engine.name, f"a weight-update group named {group_name!r}", "destroyed it")
        offsets = list(itertools.accumulate([1] + [e.tp_size for e in self.engines[:-1]]))
        world_size = 1 + sum(e.tp_size for e in self.engines)
        # Daemon threads, not a pool: a server that refuses to join leaves the others (and this
        # process's rendezvous) waiting until their timeouts, which must not hold this process.
        ours = _in_thread(
            weight_update_group,
            backend=backend,
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            rank=0,
            group_name=group_name,
            timeout_s=timeout_s,
        )
        joins = [
            _in_thread(
                e.init_weights_update_group,
                master_address,
                master_port,
                offset,
                world_size,
                group_name=group_name,
                backend=backend,
            )
            for e, offset in zip(self.engines, offsets, strict=True)
        ]
        wait([ours, *joins], return_when=FIRST_EXCEPTION)
        for join in joins:
            refused = join.exception() if join.done() else None
            if refused is not None:
                raise refused  # SGLang's own answer, naming the server
        self._group = ours.result()
        for join in joins:
            join.result()

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """Broadcast one bucket to every server; returns the bytes broadcast. `version` is not sent
        (see `SGLangWeightUpdates.update_weights_from_distributed`)."""
        if self._broken is not None:
            raise EngineError(self._broken, "an earlier broadcast was refused: the weight-update group is out of step")
        bucket = flattened_bucket(named)
        meta = bucket["metadata"]
        names, dtypes, shapes = [m.name for m in meta], [m.dtype for m in meta], [list(m.shape) for m in meta]
        announcement = (names, dtypes, shapes, self.group_name, version)
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="sglang-announce") as pool:
            announced = {
                e.name: pool.submit(carried(e.update_weights_from_distributed), *announcement, flattened=True)
                for e in self.engines
            }
            work = torch.distributed.broadcast(bucket["flattened_tensor"], src=0, group=self._group, async_op=True)
            for name, answer in announced.items():
                try:
                    answer.result()
                except EngineError:
                    self._broken = name
                    self._group.abort()
                    raise
            work.wait()
        return int(bucket["flattened_tensor"].numel())

    def close(self) -> None:
        """Destroy the group on every server (one that fails to is a warning line), then here."""
        _destroy_group_quietly(self.engines, self.group_name)
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None


def _in_thread(call: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """`call(*args, **kwargs)` in a daemon thread of its own, in the caller's trace context; its
    outcome, as a future."""
    future: Future[T] = Future()
    call = carried(call)

    def run() -> None:
        try:
            future.set_result(call(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=f"sglang-{getattr(call, '__name__', 'call')}", daemon=True).start()
    return future
