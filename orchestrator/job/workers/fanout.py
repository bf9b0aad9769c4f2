"""The driver's view of its workers as the lifecycle's Protocols.

Each call fans out to every worker and waits for all of them (`WorkerPool`), so the lifecycle's
order holds on every GPU: no replica resumes its KV cache before every rank has dropped its
params, and no rank rebuilds before every replica has released.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from orchestrator.adapters.registry import Registry
from orchestrator.errors import ConfigError, RankFailed
from orchestrator.job.workers.engine_replica import EngineReplica
from orchestrator.job.workers.payloads import SerializedBucket
from orchestrator.job.workers.pool import WorkerPool
from orchestrator.job.workers.staging import Slot
from orchestrator.job.workers.trainer_rank import WEIGHT_GROUP, Batch, TrainerRank
from orchestrator.protocols import BucketSink, JobEngine, Named, TransferReport, WeightTransport
from states import EngineMemory, Mode, TrainerLayout, TrainingSetup

if TYPE_CHECKING:
    from orchestrator.adapters.engines.sglang import SGLangGroup


class DistributedTrainer:
    """Trainer + MemoryRegions over every rank, as one object.

    What is true now is read from every rank: a tag paused on any rank is paused (a call that
    failed on one rank may have taken effect on the others), and a step begun on any rank moved
    the mains. So recover's calls go to every rank, where each rank's adapter makes a call whose
    work is done a no-op with a note.
    """

    def __init__(self, ranks: WorkerPool[TrainerRank]) -> None:
        self.ranks = ranks

    def layout(self) -> TrainerLayout:
        return self.ranks.one(0, TrainerRank.layout)

    def setup(self) -> TrainingSetup:
        """The ranks' Megatron configs as a `TrainingSetup`; ranks that disagree are a ConfigError."""
        setups = self.ranks.all(TrainerRank.setup)
        if any(s != setups[0] for s in setups):
            raise ConfigError([f"rank {r} is configured differently: {s}" for r, s in enumerate(setups)])
        return setups[0]

    def stash(self, mode: Mode) -> int:
        return sum(self.ranks.all(TrainerRank.stash, mode))

    def rebuild(self, mode: Mode) -> int:
        return sum(self.ranks.all(TrainerRank.rebuild, mode))

    def digests(self) -> Mapping[str, str]:
        """Every rank's digests, so a mismatch names the rank as well as the tensor."""
        per_rank = self.ranks.all(TrainerRank.digests)
        return {f"rank{r}:{name}": d for r, digests in enumerate(per_rank) for name, d in digests.items()}

    def host_pinned_bytes(self) -> int:
        """Per rank: every rank pins the same."""
        return max(self.ranks.all(TrainerRank.host_pinned_bytes))

    def mains_generation(self) -> int:
        """The sum of every rank's count: it moves when any rank begins a step."""
        return sum(self.ranks.all(TrainerRank.mains_generation))

    def tags(self) -> frozenset[str]:
        return frozenset(self.ranks.one(0, TrainerRank.tags))

    def region_bytes(self) -> dict[str, int]:
        """Per region tag, the most any rank holds once its optimizer has stepped."""
        each = self.ranks.all(TrainerRank.region_bytes)
        return {tag: max(r[tag] for r in each) for tag in each[0]}

    def unallocated_bytes(self) -> int:
        """The most any rank's regions will hold beyond what they hold now (`TrainerRank.unallocated_bytes`)."""
        return max(self.ranks.all(TrainerRank.unallocated_bytes))

    def host_arena_bytes(self) -> int:
        """Per rank, what its regions' host arenas pin: every rank pins the same."""
        return max(self.ranks.all(TrainerRank.host_arena_bytes))

    @property
    def paused(self) -> frozenset[str]:
        """The tags paused on any rank."""
        return frozenset().union(*self.ranks.all(TrainerRank.paused))

    def pause(self, tag: str) -> int:
        return sum(self.ranks.all(TrainerRank.pause, tag))

    def resume(self, tag: str) -> int:
        return sum(self.ranks.all(TrainerRank.resume, tag))

    def train(self, batch: Batch) -> float:
        losses = self.ranks.all(TrainerRank.train, batch)
        return sum(losses) / len(losses)

    def save_checkpoint(self, directory: str) -> None:
        self.ranks.all(TrainerRank.save_checkpoint, directory)

    def load_checkpoint(self, directory: str, rng: bool) -> None:
        self.ranks.all(TrainerRank.load_checkpoint, directory, rng)

    def device_memory(self) -> list[tuple[int, int]]:
        """(free, total) bytes of each rank's GPU, in rank order."""
        return self.ranks.all(TrainerRank.device_memory)

    def converted_digests(self) -> dict[str, str]:
        return self.ranks.one(0, TrainerRank.converted_digests)

    def weights_sha256(self) -> str:
        """One SHA256 over rank 0's converted (HF) weights: each tensor's SHA256, by name."""
        lines = "".join(f"{name} {digest}\n" for name, digest in sorted(self.converted_digests().items()))
        return hashlib.sha256(lines.encode()).hexdigest()


class ReplicaSet:
    """The RolloutEngine Protocol (and the engine's work) over every engine replica: one call
    is made on all of them, and a rollout is split between them in contiguous shares."""

    def __init__(self, replicas: WorkerPool[EngineReplica]) -> None:
        self.replicas = replicas
        self.name = "transformers" if len(replicas) == 1 else f"transformers x{len(replicas)}"
        if replicas.remote:
            self.name += " (ray actor)" if len(replicas) == 1 else " (ray actors)"

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self.replicas.all(EngineReplica.release, tags)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self.replicas.all(EngineReplica.resume, tags)

    def released(self) -> frozenset[EngineMemory]:
        """The tags every replica released: a tag any replica still holds counts as resident, so
        recover releases it again (a no-op, with a note, on the replicas that had)."""
        return frozenset.intersection(*self.replicas.all(EngineReplica.released))

    def flush_cache(self) -> None:
        self.replicas.all(EngineReplica.flush_cache)

    def weight_version(self) -> int | None:
        """The version every replica serves; None while any serves none. Replicas that disagree
        report the oldest, so the guards judge the staler one."""
        versions = self.replicas.all(EngineReplica.weight_version)
        return None if any(v is None for v in versions) else min(v for v in versions if v is not None)

    def is_idle(self) -> bool:
        return all(self.replicas.all(EngineReplica.is_idle))

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """Every replica loads the same bucket (a BucketSink); returns the bytes one replica wrote."""
        return max(self.replicas.all(EngineReplica.update_weights, list(named), version))

    def load_staged(self, index: int, slots: Sequence[Slot], version: int) -> int:
        return self.replicas.one(index, EngineReplica.load_staged, list(slots), version)

    def attach_staging(self, handles: Sequence[object]) -> None:
        for index, handle in enumerate(handles):
            self.replicas.one(index, EngineReplica.attach_staging, handle)

    def generate(
        self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each replica samples its share of the rows at once; the shares joined in order."""
        shares = self.replicas.all(
            EngineReplica.generate, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
        )
        return torch.cat([c for c, _ in shares]), torch.cat([lp for _, lp in shares])

    def footprint(self) -> dict[EngineMemory, int] | None:
        """What each tag takes on one replica's GPU while resident (the most any replica takes);
        None where a replica cannot say."""
        each = self.replicas.all(EngineReplica.footprint)
        if any(f is None for f in each):
            return None
        return {tag: max(f[tag] for f in each if f is not None) for tag in EngineMemory}

    reports_weights = True  # the transformers engine digests its own weights

    def digests(self) -> dict[str, str] | None:
        """Replica 0's digests when every replica holds the same weights; else each replica's,
        keyed by replica, which match no trainer's. None where an engine cannot report its weights."""
        reported = self.replicas.all(EngineReplica.digests)
        per_replica = [d for d in reported if d is not None]
        if len(per_replica) < len(reported):
            return None
        if all(d == per_replica[0] for d in per_replica):
            return per_replica[0]
        return {f"replica{i}:{name}": d for i, digests in enumerate(per_replica) for name, d in digests.items()}


def _total(reports: Sequence[TransferReport]) -> TransferReport:
    return TransferReport(
        tensors=sum(r.tensors for r in reports),
        bytes=sum(r.bytes for r in reports),
        buckets=sum(r.buckets for r in reports),
    )


class RankZeroPush:
    """WeightTransport: rank 0 pushes its converted weights straight into the engine."""

    def __init__(self, ranks: WorkerPool[TrainerRank], engine: BucketSink, bucket_bytes: int) -> None:
        self.ranks, self.engine, self.bucket_bytes = ranks, engine, bucket_bytes

    def push(self, version: int) -> TransferReport:
        return self.ranks.one(0, TrainerRank.push_weights, self.engine, version, self.bucket_bytes)


class ReplicaIpcPush:
    """WeightTransport: every rank pushes its converted weights into the replica on its GPU by
    CUDA IPC, through its staging buffer (`workers.staging`), all ranks at once. The buffer holds
    `bucket_bytes` or the largest tensor, whichever is more, and stays allocated for the run."""

    def __init__(self, ranks: WorkerPool[TrainerRank], replicas: ReplicaSet, bucket_bytes: int) -> None:
        self.ranks, self.replicas, self.bucket_bytes = ranks, replicas, bucket_bytes
        replicas.attach_staging(ranks.all(TrainerRank.share_staging, bucket_bytes))

    def push(self, version: int) -> TransferReport:
        return _total(self.ranks.all(TrainerRank.push_to_replica, self.replicas, version))


class BroadcastPush:
    """WeightTransport: rank 0 broadcasts its converted weights over the group it joined
    (`TrainerRank.join_weight_group`), to servers off its GPUs."""

    def __init__(self, ranks: WorkerPool[TrainerRank], bucket_bytes: int) -> None:
        self.ranks, self.bucket_bytes = ranks, bucket_bytes

    def push(self, version: int) -> TransferReport:
        return self.ranks.one(0, TrainerRank.broadcast_weights, version, self.bucket_bytes)


class PerTpRankPush:
    """WeightTransport: SGLang servers on the trainer's GPUs, each TP rank fed by the trainer
    rank on its GPU. Server s (in `--engine-url` order) with TP size t_s sits on ranks
    [offset_s, offset_s + t_s), offsets cumulative from 0; ranks past the last server's stay idle.

    For each bucket, every rank in use serializes it from its own memory (`PayloadSource`:
    every rank holds every weight and cuts the same buckets), each server gets its ranks'
    payloads in TP-rank order (`update_weights_from_payloads`, servers at once), and only then
    do the ranks let the bucket go. Ranks that cut different buckets fail the push before it is
    posted (`RankFailed`, naming the rank). The report counts, as `RankZeroPush` into an
    `SGLangGroup` does, each bucket's tensors once and its bytes once per server (what each
    server loaded; its TP ranks all read the same bucket)."""

    def __init__(self, ranks: WorkerPool[TrainerRank], group: SGLangGroup, bucket_bytes: int) -> None:
        tp_sizes = [e.tp_size for e in group.engines]
        needed, sizes = sum(tp_sizes), " + ".join(map(str, tp_sizes))
        if needed > len(ranks):
            problem = f"the SGLang servers have {needed} TP ranks ({sizes}) and the trainer {len(ranks)} ranks"
            raise ConfigError([f"{problem}: servers on the trainer's GPUs need one trainer rank per TP rank"])
        self.ranks, self.servers, self.bucket_bytes = ranks, group.engines, bucket_bytes
        self.used = list(range(needed))
        offsets = list(itertools.accumulate(tp_sizes, initial=0))
        self.shares = [slice(a, b) for a, b in itertools.pairwise(offsets)]  # each server's ranks

    def push(self, version: int) -> TransferReport:
        """Every bucket to every server; `version` is not sent (the servers' weight-update
        session sets it once, at its clean close: `SGLangGroup.weight_update_session`)."""
        ranks, used = self.ranks, self.used
        sent: list[SerializedBucket] = []  # rank 0's of each bucket posted
        ranks.some(used, TrainerRank.start_payloads, self.bucket_bytes)
        try:
            with ThreadPoolExecutor(len(self.servers), thread_name_prefix="sglang") as pool:
                while (bucket := _one_bucket(ranks.some(used, TrainerRank.next_payload), len(sent))) is not None:
                    self._post(pool, [s.payload for s in bucket])
                    sent.append(bucket[0])
        except BaseException as exc:
            try:
                ranks.some(used, TrainerRank.end_payloads)
            except Exception as also:
                exc.add_note(f"and the ranks may still hold their last bucket: {also}")
            raise
        ranks.some(used, TrainerRank.end_payloads)
        total = sum(b.bytes for b in sent) * len(self.servers)
        return TransferReport(tensors=sum(b.tensors for b in sent), bytes=total, buckets=len(sent))

    def _post(self, pool: ThreadPoolExecutor, payloads: list[str]) -> None:
        """Each server its ranks' payloads, at once; the first failure is raised, once every
        server has answered: the ranks must hold the bucket until then."""
        posts = [
            pool.submit(server.update_weights_from_payloads, payloads[share])
            for server, share in zip(self.servers, self.shares, strict=True)
        ]
        wait(posts)
        for post in posts:
            post.result()


def _one_bucket(serialized: Sequence[SerializedBucket | None], index: int) -> list[SerializedBucket] | None:
    """Bucket `index` as every rank in use serialized it; None once every rank is past its last.
    A rank whose bucket is not rank 0's (other tensors, or one bucket more or fewer) fails the
    push: `RankFailed`, naming it."""

    def cut(s: SerializedBucket | None) -> str:
        return "none (past its last)" if s is None else f"{s.tensors} tensors, {s.bytes} bytes"

    for rank, other in enumerate(serialized):
        if cut(other) != cut(serialized[0]):
            reason = f"its bucket {index} is {cut(other)}; rank 0's is {cut(serialized[0])}"
            raise RankFailed(f"rank {rank}", "next_payload", RuntimeError(reason))
    bucket = [s for s in serialized if s is not None]
    return bucket or None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tensor_push(ranks: WorkerPool[TrainerRank], engine: JobEngine, bucket_bytes: int) -> WeightTransport:
    """Weights into the engine's own memory: each replica's from the rank on its GPU (CUDA IPC);
    each SGLang server's TP rank from the trainer rank on its GPU, where the trainer has several
    (`PerTpRankPush`); else a single engine's (a replica, or every SGLang server) from rank 0,
    which holds every weight; in one copy where the engine shares the rank's process."""
    from orchestrator.adapters.engines.sglang import SGLangGroup

    if isinstance(engine, ReplicaSet) and len(engine.replicas) > 1:
        return ReplicaIpcPush(ranks, engine, bucket_bytes)
    if isinstance(engine, SGLangGroup) and len(ranks) > 1:
        return PerTpRankPush(ranks, engine, bucket_bytes)
    if isinstance(engine, ReplicaSet) and not (engine.replicas.remote or ranks.remote):
        # Rank and engine in this process: the engine is handed views of the params, so a bucket
        # holds no copy of its own, and one bucket carries the model in one multi-tensor copy.
        bucket_bytes = sys.maxsize
    return RankZeroPush(ranks, engine, bucket_bytes)


def broadcast_push(ranks: WorkerPool[TrainerRank], engine: JobEngine, bucket_bytes: int) -> WeightTransport:
    """Weights over a process group rank 0 hosts, to SGLang servers off the trainer's GPUs."""
    from orchestrator.adapters.engines.sglang import SGLangGroup

    if not isinstance(engine, SGLangGroup):
        raise ConfigError([f"weight sync by broadcast needs SGLang servers; the engine is {engine.name}"])
    servers = engine.engines
    engine.destroy_at_close(WEIGHT_GROUP)
    ranks.one(0, TrainerRank.join_weight_group, [e.name for e in servers], [e.tp_size for e in servers], _free_port())
    return BroadcastPush(ranks, bucket_bytes)


# How the trained weights reach the engine, by `colocate run --weight-sync`.
TransportFactory = Callable[[WorkerPool[TrainerRank], JobEngine, int], WeightTransport]
WEIGHT_SYNCS: Registry[TransportFactory] = Registry("weight sync", {"tensor": tensor_push, "broadcast": broadcast_push})
