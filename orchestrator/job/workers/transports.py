"""How the trained weights reach the engine: the weight transports over the job's workers, and
`WEIGHT_SYNCS`, the factories `colocate run --weight-sync` names.
"""

from __future__ import annotations

import itertools
import socket
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from orchestrator.adapters.registry import Registry
from orchestrator.errors import ConfigError, RankFailed
from orchestrator.job.workers.facades import ReplicaSet
from orchestrator.job.workers.payloads import SerializedBucket
from orchestrator.job.workers.pool import WorkerPool
from orchestrator.job.workers.trainer_rank import WEIGHT_GROUP, TrainerRank
from orchestrator.protocols import BucketSink, RolloutEngine, TransferReport, WeightTransport
from orchestrator.telemetry.tracing import carried

if TYPE_CHECKING:
    from orchestrator.adapters.engines.sglang import SGLangGroup


def _total(reports: Sequence[TransferReport]) -> TransferReport:
    return TransferReport(
        tensors=sum(r.tensors for r in reports),
        bytes=sum(r.bytes for r in reports),
        buckets=sum(r.buckets for r in reports),
    )


class RankZeroPush:
    """WeightTransport: the sync source (rank 0, while PP is 1) pushes its converted weights
    straight into the engine. Every rank is called, at once: where a rank holds part of the model
    (TP, EP) the conversion's gathers are collectives the others join, sending nothing."""

    def __init__(self, ranks: WorkerPool[TrainerRank], engine: BucketSink, bucket_bytes: int) -> None:
        self.ranks, self.engine, self.bucket_bytes = ranks, engine, bucket_bytes

    def push(self, version: int) -> TransferReport:
        return _total(self.ranks.all(TrainerRank.push_weights, self.engine, version, self.bucket_bytes))


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
            pool.submit(carried(server.update_weights_from_payloads), payloads[share])
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


def tensor_push(ranks: WorkerPool[TrainerRank], engine: RolloutEngine, bucket_bytes: int) -> WeightTransport:
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


def broadcast_push(ranks: WorkerPool[TrainerRank], engine: RolloutEngine, bucket_bytes: int) -> WeightTransport:
    """Weights over a process group rank 0 hosts, to SGLang servers off the trainer's GPUs."""
    from orchestrator.adapters.engines.sglang import SGLangGroup

    if not isinstance(engine, SGLangGroup):
        raise ConfigError([f"weight sync by broadcast needs SGLang servers; the engine is {engine.name}"])
    servers = engine.engines
    engine.destroy_at_close(WEIGHT_GROUP)
    ranks.one(0, TrainerRank.join_weight_group, [e.name for e in servers], [e.tp_size for e in servers], _free_port())
    return BroadcastPush(ranks, bucket_bytes)


# How the trained weights reach the engine, by `colocate run --weight-sync`.
TransportFactory = Callable[[WorkerPool[TrainerRank], RolloutEngine, int], WeightTransport]
WEIGHT_SYNCS: Registry[TransportFactory] = Registry("weight sync", {"tensor": tensor_push, "broadcast": broadcast_push})
