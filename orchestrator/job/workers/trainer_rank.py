"""One trainer rank in its process: Megatron-core DDP + DistributedOptimizer, its memory regions,
its shard of each batch, and the weight push to the engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import trace

from orchestrator.adapters.transport.bucketed import push_in_buckets
from orchestrator.core.config import DigestMethod
from orchestrator.job.layout import run_layout
from orchestrator.job.workers.payloads import PayloadSource
from orchestrator.job.workers.share import RankShare
from orchestrator.job.workers.traced import Traced
from orchestrator.protocols import BucketSink, Named, TrainerState, TransferReport
from orchestrator.telemetry import semconv
from states import Mode, TrainerLayout, TrainingSetup

if TYPE_CHECKING:
    from orchestrator.adapters.engines.sglang import WeightBroadcaster
    from orchestrator.adapters.registry import OwnedRegions
    from orchestrator.job.grpo import TrainStep
    from orchestrator.job.workers.staging import LoadsStaged, StagingBuffer


# The name of the weight-update group rank 0 hosts for SGLang servers off its GPUs (`--weight-sync broadcast`).
WEIGHT_GROUP = "colocate_weights"


def _note_arena(regions: Any) -> None:
    """On the current span (`rank.setup`): the host arenas torch_memory_saver's regions pinned at
    set-up, bytes and seconds; nothing for the CPU's regions, which pin none."""
    arena = getattr(regions, "arena_setup", None)
    if arena is not None:
        attributes = {semconv.HOST_ARENA_BYTES: arena[0], semconv.HOST_ARENA_SECONDS: arena[1]}
        trace.get_current_span().set_attributes(attributes)


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's rollout, as the trainer consumes it. Data-parallel rank d of D trains on rows
    d::D (the ranks of a TP group, on the same rows)."""

    prompts: torch.Tensor
    completions: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor

    def shard(self, dp_rank: int, dp_size: int) -> Batch:
        rows = slice(dp_rank, None, dp_size)
        return Batch(self.prompts[rows], self.completions[rows], self.old_logprobs[rows], self.advantages[rows])


def _sharded() -> Any:
    """Megatron's dist checkpoint of model, optimizer and RNG: imported once a rank has built megatron."""
    from orchestrator.adapters.megatron import sharded

    return sharded


def _conversion_shape(chunks: list[Any], model: Any) -> Any:
    """What the conversion reads: the tiny GPT's config, or a family model's shape as this
    megatron-core built it (`model_spec`), once every tensor converts and the config the engine
    serves computes what it does (`served_problems`); ConfigError naming each problem otherwise."""
    from orchestrator.adapters.megatron.convert import conversion_problems, model_spec
    from orchestrator.adapters.megatron.convert.served import served_problems
    from orchestrator.adapters.megatron.gpt import GPTConfig
    from orchestrator.errors import ConfigError
    from orchestrator.models import read_config

    if not isinstance(model, GPTConfig):
        return model
    problems = conversion_problems(chunks)
    if problems:
        raise ConfigError(problems)
    shape = model_spec(chunks)
    problems = served_problems(shape, read_config(model.served, source="the served config"))
    if problems:
        raise ConfigError(problems)
    return shape


def _backend(device: str) -> str:
    """torch.distributed's own choice of collective backend for `device`: gloo, nccl."""
    return str(torch.distributed.Backend.default_device_backend_map[device])


class TrainerRank(Traced, PayloadSource):
    """One trainer rank: Megatron-core DDP + DistributedOptimizer, its memory regions, its shard.
    Its converted weights reach SGLang servers on the trainer's GPUs as payloads serialized here
    (`PayloadSource`: `start_payloads`, `next_payload`, `end_payloads`).

    On the CPU: gloo and `StorageRegions`. On a GPU (`device="cuda"`): NCCL and
    torch_memory_saver regions, which return the device memory and keep the addresses. As a Ray
    actor, Ray's `CUDA_VISIBLE_DEVICES` shows it its bundle's GPU alone, as device 0.
    """

    role = semconv.ROLE_RANK
    rank: int
    share = RankShare()  # DP only until Megatron is built (and for ranks that build none)

    def __init__(
        self,
        rank: int,
        world_size: int,
        port: int,  # of the driver's rendezvous store (`job.rendezvous_store`)
        model: Any,
        step: TrainStep,  # how train takes a batch: the loss's clip, the micro-batches
        threads: int = 1,
        own_process: bool = False,
        trace_file: str | None = None,
        device: str = "cpu",
        store_host: str = "127.0.0.1",  # where the store listens: the driver's IP as the cluster reaches it
        digest: DigestMethod | None = None,  # None: the device digest on a GPU, SHA256 on the CPU
        tp: int = 1,  # tensor- and expert-parallel sizes (`job.layout`); DP: what they leave
        ep: int = 1,
    ) -> None:
        torch.set_num_threads(threads)  # ranks share the host's cores
        self.rank = rank
        if own_process:
            self.start_tracing(trace_file, rank)
            self.start_logging(f"rank {rank}")
        # megatron.core before anything that may import torch_memory_saver (orchestrator/adapters/regions/tms.py says why)
        from orchestrator.adapters.megatron.build import build_gpt, init_process_group
        from orchestrator.adapters.megatron.trainer import MegatronTrainer
        from orchestrator.adapters.registry import REGIONS

        # Megatron trains on the device this process has (its current GPU, or the CPU where it
        # sees none): the placement gives a rank a process whose device is the one it asks for.
        if (device == "cuda") != torch.cuda.is_available():
            raise RuntimeError(
                f"rank {rank}: device {device}, but torch.cuda.is_available() is {not torch.cuda.is_available()}"
            )
        self.device = device
        self.world_size, self.model, self.step = world_size, model, step
        self._staging: StagingBuffer | None = None
        self.broadcaster: WeightBroadcaster | None = None
        # The driver holds the rendezvous store, bound before any rank starts: no port to race for.
        store = torch.distributed.TCPStore(store_host, port, is_master=False, timeout=timedelta(minutes=5))
        init_process_group(
            rank, world_size, port, _backend(device), tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=run_layout(ranks=world_size, tp=tp, ep=ep).etp,
            seed=model.seed, store=store,
        )  # fmt: skip
        self.share = RankShare.current()
        self.chunks, self.optimizer = build_gpt(model)
        self.shape = _conversion_shape(self.chunks, model)
        self.trainer = MegatronTrainer(self.chunks, self.optimizer, digest=digest)
        self.regions: OwnedRegions = REGIONS[device](self.trainer.region_tensors)

    def __repr__(self) -> str:  # Ray names the actor by it in its logs and `ray list actors`
        return f"TrainerRank(rank={self.rank})"

    def close(self) -> None:
        """Leave the process group (in the driver's process, so a later job can make its own)."""
        from orchestrator.adapters.megatron.build import destroy_process_group

        self.regions.close()  # the host arenas are unpinned and freed
        if self.broadcaster is not None:
            self.broadcaster.close()
        if torch.distributed.is_initialized():
            destroy_process_group()

    def setup(self) -> TrainingSetup:
        """What this rank's real Megatron configs say (DDP config, optimizer config)."""
        from orchestrator.adapters.megatron.trainer import megatron_setup

        _note_arena(self.regions)
        return megatron_setup(self.chunks, self.optimizer)

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of this rank's GPU, as the driver sees them (`cudaMemGetInfo`):
        the engine replica sharing the GPU counts too."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    # Trainer and MemoryRegions, for this rank.
    def layout(self) -> TrainerLayout:
        return self.trainer.layout()

    def stash(self, mode: Mode) -> int:
        return self.trainer.stash(mode)

    def rebuild(self, mode: Mode) -> int:
        return self.trainer.rebuild(mode)

    def digests(self) -> dict[str, str]:
        return dict(self.trainer.digests())

    def state(self) -> TrainerState:
        """The trainer's state and its regions', in one answer: one round trip per event."""
        return replace(self.trainer.state(), regions=self.regions.state())

    def tags(self) -> frozenset[str]:
        return self.regions.tags()

    def region_bytes(self) -> dict[str, int]:
        return self.trainer.region_bytes()

    def unallocated_bytes(self) -> int:
        """What the regions will hold and do not yet: the Adam moments, before the first step."""
        from orchestrator.adapters.regions.storage import storages_by_tag

        held = sum(s.nbytes() for storages in storages_by_tag(self.trainer.region_tensors()).values() for s in storages)
        return sum(self.trainer.region_bytes().values()) - held

    def pause(self, tag: str) -> int:
        trace.get_current_span().set_attribute(semconv.REGION, tag)  # on `rank.pause`
        return self.regions.pause(tag)

    def resume(self, tag: str) -> int:
        trace.get_current_span().set_attribute(semconv.REGION, tag)  # on `rank.resume`
        return self.regions.resume(tag)

    # Checkpoints, collectively; a load precedes the lifecycle (the RNG too, at the saved world size).
    def save_checkpoint(self, directory: str) -> None:
        _sharded().save(self.chunks, self.optimizer, Path(directory))

    def load_checkpoint(self, directory: str, rng: bool) -> None:
        _sharded().load(self.chunks, self.optimizer, Path(directory), rng=rng)

    # The work of a step.
    def train(self, batch: Batch) -> float:
        from orchestrator.job.grpo import grpo_train_step

        shard = batch.shard(self.share.dp_rank, self.share.dp_size)
        stats = grpo_train_step(
            self.chunks,
            self.optimizer,
            shard.prompts,
            shard.completions,
            shard.old_logprobs,
            shard.advantages,
            clip_eps=self.step.clip_eps,
            micro_batch=self.step.micro_batch,
        )
        return float(stats.loss)

    def converted(self) -> Iterator[Named]:
        """Every weight the engine loads, as HF names it, whole (`RankShare.converted`: gathered
        where the rank holds part of the model, a collective); not the MTP layers."""
        return self.share.converted(self.trainer, self.chunks, self.shape)

    def converted_digests(self) -> dict[str, str]:
        return self.share.digests(self.converted())

    def push_weights(self, engine: BucketSink, version: int, bucket_bytes: int) -> TransferReport:
        """A sync source sends every (converted) weight to the engine; the others join the gathers."""
        return self.share.push(self.converted(), engine, version, bucket_bytes)

    def share_staging(self, bucket_bytes: int) -> Any:
        """Allocate this rank's staging buffer for the CUDA IPC push and return its IPC handle.

        The params live in torch_memory_saver regions (cuMemCreate + cuMemMap), which legacy
        CUDA IPC (`cudaIpcGetMemHandle`, what torch shares tensors by) refuses with "invalid
        argument". So weights travel through this buffer, a plain allocation outside every
        region, at least as large as the largest converted tensor."""
        from orchestrator.job.workers.staging import StagingBuffer

        largest = max(t.numel() * t.element_size() for _, t in self.converted())
        self._staging = StagingBuffer(max(bucket_bytes, largest))
        return self._staging.handle()

    def push_to_replica(self, replicas: LoadsStaged, version: int) -> TransferReport:
        """Every (converted) weight into the engine replica on this rank's GPU, through the
        staging buffer: each rank holds every weight (DP), and its replica reads them by CUDA IPC.
        A bucket is as large as the buffer: each one costs a call to the replica."""
        if self._staging is None:
            raise RuntimeError(f"rank {self.rank}: push_to_replica before share_staging")
        sink = self._staging.sink(replicas, self.rank)
        return push_in_buckets(self.converted(), sink, version, bucket_bytes=self._staging.buffer.numel())

    def join_weight_group(self, urls: Sequence[str], tp_sizes: Sequence[int], port: int) -> None:
        """Host SGLang's weight-update group for servers off this rank's GPU (rank 0 of it)."""
        from orchestrator.adapters.engines.sglang import SGLangEngine, WeightBroadcaster

        engines = [SGLangEngine(url, tp_size=tp) for url, tp in zip(urls, tp_sizes, strict=True)]
        self.broadcaster = WeightBroadcaster(
            engines, master_port=port, backend=_backend(self.device), group_name=WEIGHT_GROUP
        )

    def broadcast_weights(self, version: int, bucket_bytes: int) -> TransferReport:
        """Rank 0 broadcasts every (converted) weight over the group `join_weight_group` made."""
        if self.broadcaster is None:
            raise RuntimeError(f"rank {self.rank}: broadcast_weights before join_weight_group")
        return push_in_buckets(self.converted(), self.broadcaster, version, bucket_bytes=bucket_bytes)
