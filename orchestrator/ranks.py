"""Trainer ranks and the engine, in process or as Ray actors, behind the lifecycle's Protocols.

The driver holds the one `Lifecycle`. Each of its calls on the trainer or the regions fans out
to every rank and waits for all of them, bounded by a timeout: a rank that dies or hangs
becomes a `RankFailed` naming it, which the lifecycle turns into FAULTED.

`RankWorker` is the whole of one rank. With `--ranks 1` it lives in the driver; with more, each
is a Ray actor in one placement group, their torch.distributed group over gloo, and the engine
is an actor of its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from orchestrator.errors import ConfigError, LifecycleError, RankFailed
from orchestrator.protocols import MemoryRegions, TransferReport
from orchestrator.transport import Named, push_in_buckets
from states import EngineMemory, Mode, TrainerLayout, TrainingSetup

RANK_TIMEOUT_S = 120.0
# Building a rank (imports, the model, the process group) on a loaded host takes far longer than
# a call should: start-up waits at least this long, whatever --rank-timeout says.
START_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's rollout, as the trainer consumes it. Rank r trains on rows r::world_size."""

    prompts: torch.Tensor
    completions: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor

    def shard(self, rank: int, world_size: int) -> Batch:
        rows = slice(rank, None, world_size)
        return Batch(self.prompts[rows], self.completions[rows], self.old_logprobs[rows], self.advantages[rows])


class Traced:
    """A process-side object the driver calls: every call is one span, `<role>.<method>`.

    The caller's trace context arrives as W3C headers, so the span joins the step's trace
    whichever process it runs in. Host memory before and after the call is recorded (RSS), and
    a rank's spans (the nested ones too) carry its `colocate.rank`.
    """

    role = "worker"
    rank: int | None = None
    _provider: Any = None
    # Queries the lifecycle makes around every transition, and the driver's housekeeping: spans
    # for them would bury the work (or, for flush_traces, be roots of traces of their own).
    untraced = frozenset(
        {"ready", "tags", "layout", "weight_version", "is_idle", "host_pinned_bytes", "probe", "flush_traces"}
    )

    def start_tracing(self, trace_file: str | None, rank: int | None = 0) -> None:
        """In a process of its own: a tracer provider of this role and rank, from the `OTEL_*`
        variables and `trace_file`, set as the global one (nothing if neither asks for spans)."""
        from opentelemetry import trace

        from orchestrator.tracing import configure_tracing

        path = Path(trace_file) if trace_file else None
        self._provider = configure_tracing(rank=rank, trace_file=path, role=self.role)
        if self._provider is not None:
            trace.set_tracer_provider(self._provider)

    def invoke(self, headers: dict[str, str], method: str, *args: Any, **kwargs: Any) -> Any:
        from orchestrator.tracing import continued, process_span

        if method in self.untraced:
            return getattr(self, method)(*args, **kwargs)
        with continued(headers, rank=self.rank), process_span(f"{self.role}.{method}") as span:
            result = getattr(self, method)(*args, **kwargs)
            if isinstance(result, int) and not isinstance(result, bool):
                span.set_attribute("colocate.bytes", result)
            return result

    def probe(self) -> int:
        """This process's id. Called on the control thread, so a process whose work is blocked
        (in a collective waiting for a peer) still answers, and one that is stopped or dead does not."""
        return os.getpid()

    def flush_traces(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()


class RankWorker(Traced):
    """One trainer rank: Megatron-core DDP + DistributedOptimizer, its memory regions, its shard.

    On the CPU: gloo and `StorageRegions`. On a GPU (`device="cuda"`): NCCL and
    torch_memory_saver regions, which return the device memory and keep the addresses.
    """

    role = "rank"
    rank: int

    def __init__(
        self,
        rank: int,
        world_size: int,
        port: int,  # of the driver's rendezvous store (`rendezvous_store`)
        model: Any,
        clip_eps: float,
        threads: int = 1,
        own_process: bool = False,
        trace_file: str | None = None,
        device: str = "cpu",
        store_host: str = "127.0.0.1",  # where the store listens: the driver's IP as the cluster reaches it
    ) -> None:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        torch.set_num_threads(threads)  # ranks share the host's cores
        self.rank = rank
        if own_process:
            self.start_tracing(trace_file, rank)
        # megatron.core before anything that may import torch_memory_saver (design §4)
        from orchestrator.adapters.megatron import MegatronTrainer
        from orchestrator.adapters.megatron_build import build_gpt, init_process_group
        from orchestrator.adapters.storage import StorageRegions

        cuda = device == "cuda"
        if cuda != torch.cuda.is_available():
            raise RuntimeError(f"rank {rank}: device {device}, but torch.cuda.is_available() is {not cuda}")
        self.rank, self.world_size, self.model, self.clip_eps = rank, world_size, model, clip_eps
        # The driver holds the rendezvous store, bound before any rank starts: no port to race for.
        store = torch.distributed.TCPStore(store_host, port, is_master=False, timeout=timedelta(minutes=5))
        init_process_group(rank, world_size, port, "nccl" if cuda else "gloo", seed=model.seed, store=store)
        self.chunks, self.optimizer = build_gpt(model)
        self.trainer = MegatronTrainer(self.chunks, self.optimizer)
        if cuda:
            from orchestrator.adapters.tms import TorchMemorySaverRegions

            self.regions: MemoryRegions = TorchMemorySaverRegions(self.trainer.region_tensors)
        else:
            self.regions = StorageRegions(self.trainer.region_tensors)

    def __repr__(self) -> str:  # Ray names the actor by it in its logs and `ray list actors`
        return f"RankWorker(rank={self.rank})"

    def ready(self) -> int:
        """This process's id, once the rank is built."""
        return os.getpid()

    def close(self) -> None:
        """Leave the process group (in the driver's process, so a later job can make its own)."""
        from orchestrator.adapters.megatron_build import destroy_process_group

        if torch.distributed.is_initialized():
            destroy_process_group()

    def setup(self) -> TrainingSetup:
        """What this rank's real Megatron configs say (DDP config, optimizer config)."""
        from orchestrator.adapters.megatron import megatron_setup

        return megatron_setup(self.chunks, self.optimizer)

    # Trainer and MemoryRegions, for this rank.
    def layout(self) -> TrainerLayout:
        return self.trainer.layout()

    def stash(self, mode: Mode) -> int:
        return self.trainer.stash(mode)

    def rebuild(self, mode: Mode) -> int:
        return self.trainer.rebuild(mode)

    def digests(self) -> dict[str, str]:
        return dict(self.trainer.digests())

    def host_pinned_bytes(self) -> int:
        return self.trainer.host_pinned_bytes()

    def tags(self) -> frozenset[str]:
        return self.regions.tags()

    def pause(self, tag: str) -> int:
        return self.regions.pause(tag)

    def resume(self, tag: str) -> int:
        return self.regions.resume(tag)

    # The work of a step.
    def train(self, batch: Batch) -> float:
        from orchestrator.grpo import grpo_train_step

        shard = batch.shard(self.rank, self.world_size)
        stats = grpo_train_step(
            self.chunks,
            self.optimizer,
            shard.prompts,
            shard.completions,
            shard.old_logprobs,
            shard.advantages,
            clip_eps=self.clip_eps,
        )
        return float(stats.loss)

    def converted(self) -> Iterator[Named]:
        from orchestrator.convert import to_hf

        for name, tensor in self.trainer.sync_tensors():
            yield from to_hf(name, tensor, self.model)

    def push_weights(self, engine: EngineClient, version: int, bucket_bytes: int) -> TransferReport:
        """Rank 0 sends every (converted) weight to the engine: with TP = 1 it holds them all."""
        return push_in_buckets(self.converted(), engine, version, bucket_bytes=bucket_bytes)

    def join_weight_group(self, urls: list[str], tp_sizes: list[int], port: int) -> None:
        """Host SGLang's weight-update group for servers off this rank's GPU (rank 0 of it)."""
        from orchestrator.adapters.sglang import SGLangEngine, WeightBroadcaster

        engines = [SGLangEngine(url, tp_size=tp) for url, tp in zip(urls, tp_sizes, strict=True)]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.broadcaster = WeightBroadcaster(engines, master_port=port, backend=backend)

    def broadcast_weights(self, version: int, bucket_bytes: int) -> TransferReport:
        """Rank 0 broadcasts every (converted) weight over the group `join_weight_group` made."""
        return push_in_buckets(self.converted(), self.broadcaster, version, bucket_bytes=bucket_bytes)

    def converted_digests(self) -> dict[str, str]:
        from orchestrator.adapters.digest import sha256_digests

        return sha256_digests(dict(self.converted()))


# ---- calling ranks ------------------------------------------------------------------------


CONTROL = "control"  # each actor's second thread: probes and span flushes, never blocked by the work
PROBE_S = 2.0  # how long a live process's control thread may take to answer, on a loaded machine


def remote_class(cls: type) -> Any:
    """`cls` as a Ray actor class whose `probe` and `flush_traces` run on a thread of their own."""
    import ray

    return ray.remote(concurrency_groups={CONTROL: 1})(cls)  # type: ignore[call-overload]


def control(worker: Any, method: str) -> Any:
    """Call `method` on an actor's control thread; returns the ref."""
    return worker.invoke.options(concurrency_group=CONTROL).remote({}, method)


def _outcome(ref: Any) -> tuple[str, BaseException | None]:
    """Where a remote call stands now: ok, pending, died (its process) or raised."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        ray.get(ref, timeout=0)
    except GetTimeoutError as exc:
        return "pending", exc
    except RayTaskError as exc:  # it ran and raised, if only because an actor it called died
        return "raised", exc
    except RayActorError as exc:
        return "died", exc
    except Exception as exc:
        return "raised", exc
    return "ok", None


class Ranks:
    """Calls a method on every rank and returns their results in rank order.

    When a remote call fails, the rank named is the one at fault, not the first still busy: a
    rank whose process died comes first, then one that is stopped or answers no probe (a hang),
    then the first to raise. Ranks blocked in a collective, waiting for that one, still answer.
    """

    def __init__(self, workers: Sequence[Any], *, remote: bool, timeout: float = RANK_TIMEOUT_S) -> None:
        self.workers, self.remote, self.timeout = list(workers), remote, timeout
        self.pids: dict[int, int] = {}  # rank → process id, once `start` has seen them ready

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> None:
        """Wait for every rank to be built (within `START_TIMEOUT_S` at least), and note its process."""
        timeout, self.timeout = self.timeout, max(self.timeout, START_TIMEOUT_S)
        try:
            self.pids = dict(enumerate(self.call("ready")))
        finally:
            self.timeout = timeout

    def call(self, method: str, *args: Any, only: int | None = None) -> list[Any]:
        from orchestrator.tracing import carrier

        targets = list(enumerate(self.workers)) if only is None else [(only, self.workers[only])]
        headers = carrier()
        if not self.remote:
            return [self._local(rank, worker, headers, method, args) for rank, worker in targets]
        refs = {rank: worker.invoke.remote(headers, method, *args) for rank, worker in targets}
        return self._gather(method, refs)

    def _gather(self, method: str, refs: dict[int, Any]) -> list[Any]:
        import ray

        pending = {ref: rank for rank, ref in refs.items()}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._blame(method, refs, None)
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except Exception as exc:  # RayActorError, or the rank's own exception
                raise self._blame(method, refs, (rank, exc)) from exc
        return [results[rank] for rank in refs]

    def _blame(self, method: str, refs: dict[int, Any], first: tuple[int, BaseException] | None) -> RankFailed:
        """The failure of `method`, naming the rank at fault (see the class docstring)."""
        import ray

        probes = {rank: control(self.workers[rank], "probe") for rank in refs}
        unanswered, deadline = list(probes.values()), time.monotonic() + PROBE_S
        while unanswered and time.monotonic() < deadline:
            _, unanswered = ray.wait(unanswered, num_returns=len(unanswered), timeout=0.1)
            if all(self._stopped(rank) for rank, ref in probes.items() if ref in unanswered):
                break  # a stopped process will not answer: no need to wait it out
        died: list[tuple[int, BaseException | None]] = []
        hung: list[int] = []
        for rank in refs:
            (call, call_error), (probe, probe_error) = _outcome(refs[rank]), _outcome(probes[rank])
            if "died" in (call, probe):
                died.append((rank, call_error if call == "died" else probe_error))
            elif probe != "ok" or self._stopped(rank):
                hung.append(rank)
        if died:
            rank, cause = died[0]
            return RankFailed(f"rank {rank} (died)", method, cause or RuntimeError("died"))
        if hung:
            rank = min(hung, key=lambda r: (not self._stopped(r), r))
            how = "its process is stopped" if self._stopped(rank) else f"no answer to a probe within {PROBE_S:g} s"
            when = f"no answer within {self.timeout:g} s" if first is None else f"rank {first[0]} failed first"
            return RankFailed(f"rank {rank} (no answer)", method, TimeoutError(f"{when}; {how}"))
        if first is not None:
            return RankFailed(f"rank {first[0]}", method, first[1])
        busy = ", ".join(str(rank) for rank in refs)
        cause = TimeoutError(f"no answer within {self.timeout:g} s, though every rank is alive and answers probes")
        return RankFailed(f"rank(s) {busy} (alive, still working)", method, cause)

    def _stopped(self, rank: int) -> bool:
        """Whether the rank's process is stopped (SIGSTOP, a debugger) or a zombie."""
        import psutil

        pid = self.pids.get(rank)
        if pid is None:
            return False
        try:
            return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    @staticmethod
    def _local(rank: int, worker: Any, headers: dict[str, str], method: str, args: tuple[Any, ...]) -> Any:
        try:
            return worker.invoke(headers, method, *args)
        except LifecycleError:
            raise
        except Exception as exc:
            raise RankFailed(f"rank {rank}", method, exc) from exc


class RankGroup:
    """The trainer and its memory regions, as one object over all ranks (Trainer + MemoryRegions)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def layout(self) -> TrainerLayout:
        return self.ranks.call("layout", only=0)[0]

    def setup(self) -> TrainingSetup:
        """The ranks' Megatron configs as a `TrainingSetup`; ranks that disagree are a ConfigError."""
        setups = self.ranks.call("setup")
        if any(s != setups[0] for s in setups):
            raise ConfigError([f"rank {r} is configured differently: {s}" for r, s in enumerate(setups)])
        return setups[0]

    def stash(self, mode: Mode) -> int:
        return sum(self.ranks.call("stash", mode))

    def rebuild(self, mode: Mode) -> int:
        return sum(self.ranks.call("rebuild", mode))

    def digests(self) -> Mapping[str, str]:
        """Every rank's digests, so a mismatch names the rank as well as the tensor."""
        per_rank = self.ranks.call("digests")
        return {f"rank{r}:{name}": d for r, digests in enumerate(per_rank) for name, d in digests.items()}

    def host_pinned_bytes(self) -> int:
        """Per rank: every rank pins the same."""
        return max(self.ranks.call("host_pinned_bytes"))

    def tags(self) -> frozenset[str]:
        return frozenset(self.ranks.call("tags", only=0)[0])

    def pause(self, tag: str) -> int:
        return sum(self.ranks.call("pause", tag))

    def resume(self, tag: str) -> int:
        return sum(self.ranks.call("resume", tag))

    def train(self, batch: Batch) -> float:
        losses = self.ranks.call("train", batch)
        return sum(losses) / len(losses)


class WorkerTransport:
    """WeightTransport: rank 0 pushes its converted weights straight into the engine."""

    def __init__(self, ranks: Ranks, engine: Any, bucket_bytes: int) -> None:
        self.ranks, self.engine, self.bucket_bytes = ranks, engine, bucket_bytes

    def push(self, version: int) -> TransferReport:
        return self.ranks.call("push_weights", self.engine, version, self.bucket_bytes, only=0)[0]


class BroadcastTransport:
    """WeightTransport: rank 0 broadcasts its converted weights over the group it joined
    (`RankWorker.join_weight_group`), to servers off its GPUs."""

    def __init__(self, ranks: Ranks, bucket_bytes: int) -> None:
        self.ranks, self.bucket_bytes = ranks, bucket_bytes

    def push(self, version: int) -> TransferReport:
        return self.ranks.call("broadcast_weights", version, self.bucket_bytes, only=0)[0]


class EngineClient:
    """The RolloutEngine Protocol (and the engine's work) over an `EngineWorker`, here or in a Ray
    actor; every remote wait is bounded and every call carries the trace context."""

    def __init__(self, target: Any, *, remote: bool, timeout: float = RANK_TIMEOUT_S) -> None:
        self.target, self.remote, self.timeout = target, remote, timeout
        self.name = "transformers (ray actor)" if remote else "transformers"

    def start(self) -> None:
        """Wait for the engine's actor to be built (within `START_TIMEOUT_S` at least)."""
        if self.remote:
            import ray

            try:
                ray.get(control(self.target, "probe"), timeout=max(self.timeout, START_TIMEOUT_S))
            except Exception as exc:
                raise RankFailed("engine", "start", exc) from exc

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from orchestrator.tracing import carrier

        if not self.remote:
            return self.target.invoke(carrier(), method, *args, **kwargs)
        import ray

        try:
            return ray.get(self.target.invoke.remote(carrier(), method, *args, **kwargs), timeout=self.timeout)
        except Exception as exc:
            raise RankFailed("engine", method, exc) from exc

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self._call("release", tags)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self._call("resume", tags)

    def flush_cache(self) -> None:
        self._call("flush_cache")

    def weight_version(self) -> int | None:
        return self._call("weight_version")

    def is_idle(self) -> bool:
        return bool(self._call("is_idle"))

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        return int(self._call("update_weights", list(named), version))

    def generate(self, prompts: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._call("generate", prompts, **kwargs)

    def digests(self) -> dict[str, str]:
        return self._call("digests")


class EngineWorker(Traced):
    """The rollout engine where it runs: a TransformersEngine whose calls are spans `engine.<method>`.

    transformers is imported here, only in the process that serves rollouts.
    """

    role = "engine"

    def __init__(
        self, model: Any, *, max_batch: int, max_len: int, own_process: bool = False, trace_file: str | None = None
    ) -> None:
        if own_process:
            self.start_tracing(trace_file, rank=None)
        from orchestrator.adapters.hf_engine import TransformersEngine

        self.engine = TransformersEngine(model, max_batch=max_batch, max_len=max_len)

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet: never recurse
            raise AttributeError(name)
        return getattr(self.engine, name)
