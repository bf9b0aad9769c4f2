"""Where the job's workers run: in the driver's process (`LocalPlacement`), or as Ray actors in
one placement group (`RayPlacement`). Both start the ranks and the engine replicas and end them.

On GPUs a bundle is one GPU (and one CPU), shared by its rank and its engine replica: each takes
half of the bundle, so Ray places both there and shows both that GPU alone. On the CPU each rank
has a bundle of one CPU, and the engine one more, and its processes are shown no GPU at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from orchestrator.adapters.registry import EngineSpec
from orchestrator.core.config import DigestMethod
from orchestrator.errors import ConfigError, RankFailed
from orchestrator.job import interrupt
from orchestrator.job.workers.engine_replica import EngineReplica
from orchestrator.job.workers.facades import ReplicaSet
from orchestrator.job.workers.pool import Sentinels, WorkerPool, control, remote_class
from orchestrator.job.workers.traced import Traced
from orchestrator.job.workers.trainer_rank import TrainerRank
from orchestrator.telemetry.logs import forward

if TYPE_CHECKING:
    from orchestrator.job.grpo import TrainStep

FLUSH_S = 2.0  # how long the processes together may take to flush their spans when the job ends


class Placement(Protocol):
    """Starts the job's ranks and the replicas of an engine it runs itself; `close` ends them all."""

    def start_ranks(
        self, port: int, model: Any, step: TrainStep, digest: DigestMethod | None = None, *, tp: int = 1, ep: int = 1
    ) -> WorkerPool[TrainerRank]: ...

    def start_engine(self, kind: str, spec: EngineSpec) -> ReplicaSet: ...

    def close(self, *, flush: bool) -> None: ...


def in_process(*, ranks: int, device: str, address: str | None, cuda: bool | None = None) -> bool:
    """Whether a job's workers can run in the driver's process: one rank, no cluster named, and a
    device this process already trains on (Megatron takes the process's: its GPU where it sees one).
    `cuda`: whether this process sees a GPU (None: asked of torch now)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return ranks == 1 and address is None and (device == "cuda") == cuda


class LocalPlacement:
    """The one rank and the engine in the driver's process: the driver's tracer provider serves both."""

    def __init__(self, *, device: str) -> None:
        self.device = device
        self._workers: list[TrainerRank | EngineReplica] = []

    def start_ranks(
        self, port: int, model: Any, step: TrainStep, digest: DigestMethod | None = None, *, tp: int = 1, ep: int = 1
    ) -> WorkerPool[TrainerRank]:
        threads = torch.get_num_threads()  # the rank is this process: it keeps the process's threads
        rank = TrainerRank(0, 1, port, model, step, threads=threads, device=self.device, digest=digest, tp=tp, ep=ep)
        self._workers.append(rank)
        return WorkerPool([rank], label="rank", remote=False)

    def start_engine(self, kind: str, spec: EngineSpec) -> ReplicaSet:
        replica = EngineReplica(kind, spec)
        self._workers.append(replica)
        return ReplicaSet(WorkerPool([replica], label="engine", remote=False))

    def close(self, *, flush: bool) -> None:
        """Leave the process group and close the engine (the driver's provider flushes the spans)."""
        workers, self._workers = self._workers, []
        with contextlib.ExitStack() as closing:  # every one closed, the first failure raised
            for worker in workers:
                closing.callback(worker.close)


class RayPlacement:
    """Starts (or attaches to) Ray, then a placement group for `ranks` ranks (and the engine), then the actors.

    `trace_file(role)` names the file a process of that role writes its spans to (or None).
    `close` ends every actor it started and Ray, whatever state they are in. Every call's wait
    ends when any worker's process dies (`pool.Sentinels`), and start-up's once `stop` is set
    (Ctrl-C: KeyboardInterrupt).
    """

    def __init__(
        self,
        *,
        ranks: int,
        cuda: bool,
        engine_bundle: bool,
        timeout: float,
        trace_file: Callable[[str], str | None],
        address: str | None = None,
        store_host: str = "127.0.0.1",
        stop: threading.Event | None = None,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group

        from orchestrator.job.ray_cluster import connect

        self.ranks, self.cuda, self.timeout, self.trace_file = ranks, cuda, timeout, trace_file
        self.store_host = store_host  # where the ranks reach the driver's rendezvous store
        self.stop = stop
        self.actors: list[Any] = []  # ranks, then the engine replicas
        self.sentinels = Sentinels()  # shared by every pool: a death anywhere ends any wait
        # Each actor's own environment, never the driver's: on the CPU it is shown no GPU, so
        # Megatron and the engine take the CPU whatever GPUs the host has. The driver's `OTEL_*`
        # travel, so that on a cluster started elsewhere the ranks export where the driver does.
        self.env = (
            {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}
            | {"TORCHDYNAMO_DISABLE": "1"}
            | ({} if cuda else {"CUDA_VISIBLE_DEVICES": ""})
        )
        # The user's cluster at `address`, or a private one on loopback (`ray_cluster`).
        env = {"env_vars": self.env}
        cluster = connect(address, cpus=ranks + 1, gpus=None if cuda else 0, runtime_env=env, stop=stop)
        self._shutdown = cluster.close
        try:
            if address is not None:  # a private cluster was judged with the config: this machine's
                self._check_capacity(address, engine_bundle)
            bundles = [{"CPU": 1, "GPU": 1}] * ranks if cuda else [{"CPU": 1}] * (ranks + engine_bundle)
            self._group = placement_group(bundles, strategy="PACK")
            deadline, ready = time.monotonic() + timeout, self._group.ready()
            while not ray.wait([ready], timeout=interrupt.POLL_S)[0]:
                interrupt.check(stop)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Ray placed no group of {len(bundles)} bundle(s) within {timeout:g} s")
            ray.get(ready)
        except BaseException:
            self._shutdown()
            raise

    def _check_capacity(self, address: str, engine_bundle: bool) -> None:
        """Refuse, before any actor is placed, a run the attached cluster cannot hold: its
        placement group would wait for resources that never come."""
        import ray

        from orchestrator.job.capacity import cluster_problems

        problems = cluster_problems(
            ray.cluster_resources(), address=address, ranks=self.ranks, cuda=self.cuda, engine_bundle=engine_bundle
        )
        if problems:
            raise ConfigError(problems)

    def _options(self, bundle: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self._group, placement_group_bundle_index=bundle)
        share = {"num_cpus": 0.5, "num_gpus": 0.5} if self.cuda else {"num_cpus": 1, "num_gpus": 0}
        env = {"env_vars": self.env}
        return {**share, "scheduling_strategy": strategy, "max_restarts": 0, "runtime_env": env}

    def start_ranks(
        self, port: int, model: Any, step: TrainStep, digest: DigestMethod | None = None, *, tp: int = 1, ep: int = 1
    ) -> WorkerPool[TrainerRank]:
        """One rank per bundle, waited for until built; rank r in bundle r, so that a TP group
        (ranks TP x i .. TP x i + TP - 1, innermost as Megatron places it) is in consecutive bundles,
        which PACK puts on one node where it can."""
        rank_cls = remote_class(TrainerRank)
        workers = [
            rank_cls.options(**self._options(r)).remote(
                r, self.ranks, port, model, step, own_process=True, trace_file=self.trace_file(f"rank{r}"),
                device="cuda" if self.cuda else "cpu", store_host=self.store_host, digest=digest, tp=tp, ep=ep,
            )
            for r in range(self.ranks)
        ]  # fmt: skip
        self.actors += workers
        ranks: WorkerPool[TrainerRank] = WorkerPool(
            workers, label="rank", remote=True, timeout=self.timeout, sentinels=self.sentinels
        )
        ranks.start(self.stop)
        return ranks

    def start_engine(self, kind: str, spec: EngineSpec) -> ReplicaSet:
        """On GPUs a replica in each rank's bundle, each serving `1 / ranks` of a rollout's rows;
        on the CPU one engine, in the last bundle."""
        count = self.ranks if self.cuda else 1
        share = dataclasses.replace(spec, max_batch=spec.max_batch // count)
        replica_cls = remote_class(EngineReplica)
        actors = [
            replica_cls.options(**self._options(i if self.cuda else self.ranks)).remote(
                kind, share, index=i, replicas=count, own_process=True,
                trace_file=self.trace_file("engine" if count == 1 else f"engine{i}"),
            )
            for i in range(count)
        ]  # fmt: skip
        self.actors += actors
        replicas: WorkerPool[EngineReplica] = WorkerPool(
            actors, label="engine", remote=True, timeout=self.timeout, sentinels=self.sentinels
        )
        try:
            replicas.start(self.stop)
        except Exception as exc:
            raise RankFailed("engine", "start", exc) from exc
        return ReplicaSet(replicas)

    def close(self, *, flush: bool) -> None:
        """Take the log lines every process kept since its last answer, and flush the spans of
        every one that has some to give (if `flush`), within `FLUSH_S` in all (a dead or stopped
        one has none), then end the actors and Ray."""
        import ray

        try:
            if self.actors:
                lines = [control(actor, Traced.take_lines) for actor in self.actors]
                flushed = [control(actor, Traced.flush_traces) for actor in self.actors] if flush else []
                ray.wait([*lines, *flushed], num_returns=len(lines) + len(flushed), timeout=FLUSH_S)
                for ref in lines:
                    try:
                        kept = ray.get(ref, timeout=0)
                    except Exception:  # dead, stopped or slow: what it kept is lost with it
                        continue
                    forward(kept)
            for actor in self.actors:  # SIGKILL: a stopped process obeys it too
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        finally:
            self.actors = []
            self._shutdown()
