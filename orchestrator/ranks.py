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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.errors import ConfigError, LifecycleError, RankFailed
from orchestrator.protocols import MemoryRegions, TransferReport
from orchestrator.transport import Named, push_in_buckets
from states import EngineMemory, Mode, TrainerLayout, TrainingSetup

RANK_TIMEOUT_S = 120.0


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


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class Traced:
    """A process-side object the driver calls: every call is one span, `<role>.<method>`.

    The caller's trace context arrives as W3C headers, so the span joins the step's trace
    whichever process it runs in. Host memory before and after the call is recorded (RSS).
    """

    role = "worker"
    _provider: Any = None
    # Queries the lifecycle makes around every transition: spans for them would bury the work.
    untraced = frozenset({"ready", "tags", "layout", "weight_version", "is_idle", "host_pinned_bytes"})

    def span_attributes(self) -> dict[str, int]:
        return {}

    def start_tracing(self, trace_file: str | None, rank: int = 0) -> None:
        """In a process of its own: a tracer provider of this role and rank, from the `OTEL_*`
        variables and `trace_file`, set as the global one (nothing if neither asks for spans)."""
        from opentelemetry import trace

        from orchestrator.tracing import configure_tracing

        path = Path(trace_file) if trace_file else None
        self._provider = configure_tracing(rank=rank, trace_file=path, role=self.role)
        if self._provider is not None:
            trace.set_tracer_provider(self._provider)

    def invoke(self, headers: dict[str, str], method: str, *args: Any, **kwargs: Any) -> Any:
        from opentelemetry import trace

        from orchestrator.tracing import continued

        if method in self.untraced:
            return getattr(self, method)(*args, **kwargs)
        attributes = {"colocate.memory_before": _rss(), **self.span_attributes()}
        with (
            continued(headers),
            trace.get_tracer("colocate").start_as_current_span(f"{self.role}.{method}", attributes=attributes) as span,
        ):
            result = getattr(self, method)(*args, **kwargs)
            span.set_attribute("colocate.memory_after", _rss())
            if isinstance(result, int) and not isinstance(result, bool):
                span.set_attribute("colocate.bytes", result)
            return result

    def flush_traces(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()


class RankWorker(Traced):
    """One trainer rank: Megatron-core DDP + DistributedOptimizer, its memory regions, its shard.

    On the CPU: gloo and `StorageRegions`. On a GPU (`device="cuda"`): NCCL and
    torch_memory_saver regions, which return the device memory and keep the addresses.
    """

    role = "rank"

    def __init__(
        self,
        rank: int,
        world_size: int,
        port: int,
        model: Any,
        clip_eps: float,
        threads: int = 1,
        own_process: bool = False,
        trace_file: str | None = None,
        device: str = "cpu",
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
        init_process_group(rank, world_size, port, "nccl" if cuda else "gloo", seed=model.seed)
        self.chunks, self.optimizer = build_gpt(model)
        self.trainer = MegatronTrainer(self.chunks, self.optimizer)
        if cuda:
            from orchestrator.adapters.tms import TorchMemorySaverRegions

            self.regions: MemoryRegions = TorchMemorySaverRegions(self.trainer.region_tensors)
        else:
            self.regions = StorageRegions(self.trainer.region_tensors)

    def ready(self) -> int:
        return self.rank

    def span_attributes(self) -> dict[str, int]:
        return {"colocate.rank": self.rank}

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


class Ranks:
    """Calls a method on every rank and returns their results in rank order."""

    def __init__(self, workers: Sequence[Any], *, remote: bool, timeout: float = RANK_TIMEOUT_S) -> None:
        self.workers, self.remote, self.timeout = list(workers), remote, timeout

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, method: str, *args: Any, only: int | None = None) -> list[Any]:
        from orchestrator.tracing import carrier

        targets = list(enumerate(self.workers)) if only is None else [(only, self.workers[only])]
        headers = carrier()
        if not self.remote:
            return [self._local(rank, worker, headers, method, args) for rank, worker in targets]
        import ray

        refs = [worker.invoke.remote(headers, method, *args) for _, worker in targets]
        try:
            return list(ray.get(refs, timeout=self.timeout))
        except Exception as exc:  # RayActorError, GetTimeoutError, a rank's own exception
            rank = _failed_rank(refs, targets)
            raise RankFailed(f"rank {rank}", method, exc) from exc

    @staticmethod
    def _local(rank: int, worker: Any, headers: dict[str, str], method: str, args: tuple[Any, ...]) -> Any:
        try:
            return worker.invoke(headers, method, *args)
        except LifecycleError:
            raise
        except Exception as exc:
            raise RankFailed(f"rank {rank}", method, exc) from exc


def _failed_rank(refs: list[Any], targets: list[tuple[int, Any]]) -> str:
    """The first rank whose call did not succeed (or 'unknown' if all look fine now)."""
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref, (rank, _) in zip(refs, targets, strict=True):
        if ref not in ready:
            return f"{rank} (no answer)"
        try:
            ray.get(ref, timeout=0)
        except Exception:
            return str(rank)
    return "unknown"


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

    def flush_traces(self) -> None:
        self.ranks.call("flush_traces")


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

    def flush_traces(self) -> None:
        self._call("flush_traces")


class EngineWorker(Traced):
    """The rollout engine where it runs: a TransformersEngine whose calls are spans `engine.<method>`.

    transformers is imported here, only in the process that serves rollouts.
    """

    role = "engine"

    def __init__(
        self, model: Any, *, max_batch: int, max_len: int, own_process: bool = False, trace_file: str | None = None
    ) -> None:
        if own_process:
            self.start_tracing(trace_file)
        from orchestrator.adapters.hf_engine import TransformersEngine

        self.engine = TransformersEngine(model, max_batch=max_batch, max_len=max_len)

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet: never recurse
            raise AttributeError(name)
        return getattr(self.engine, name)


def start_ray(ranks: int) -> Callable[[], None]:
    """A local Ray with one logical CPU per actor (ranks + engine); returns its shutdown."""
    import logging
    import tempfile

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=ranks + 1,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        _temp_dir=tempfile.mkdtemp(prefix="colocate-ray-"),
        runtime_env={"env_vars": {"TORCHDYNAMO_DISABLE": "1"}},
    )
    return ray.shutdown
