"""The driver's view of its workers as the lifecycle's Protocols: the rank group and the replica set.

Each call fans out to every worker and waits for all of them (`WorkerPool`), so the lifecycle's
order holds on every GPU: no replica resumes its KV cache before every rank has dropped its
params, and no rank rebuilds before every replica has released. What each worker reports comes
back in one `state()` call per worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from orchestrator.errors import ConfigError
from orchestrator.job.workers.engine_replica import EngineReplica
from orchestrator.job.workers.pool import WorkerPool
from orchestrator.job.workers.staging import Slot
from orchestrator.job.workers.trainer_rank import Batch, TrainerRank
from orchestrator.protocols import EngineDefaults, EngineFeatures, EngineState, Named, RegionsState, TrainerState
from states import EngineMemory, Mode, TrainerLayout, TrainingSetup


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

    def state(self) -> TrainerState:
        """Every rank's state and its regions', in one round trip per rank: the mains' generation
        is the sum of every rank's count (it moves when any rank begins a step); a tag paused on
        any rank is paused; pinned bytes are per rank (every rank pins the same)."""
        each = self.ranks.all(TrainerRank.state)
        regions = [s.regions for s in each if s.regions is not None]
        return TrainerState(
            mains_generation=sum(s.mains_generation for s in each),
            host_pinned_bytes=max(s.host_pinned_bytes for s in each),
            regions=RegionsState(
                paused=frozenset().union(*(r.paused for r in regions)),
                host_arena_bytes=max(r.host_arena_bytes for r in regions),
            ),
        )

    def host_pinned_bytes(self) -> int:
        return self.state().host_pinned_bytes

    def mains_generation(self) -> int:
        return self.state().mains_generation

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
        return self._regions().host_arena_bytes

    @property
    def paused(self) -> frozenset[str]:
        return self._regions().paused

    def _regions(self) -> RegionsState:
        regions = self.state().regions
        assert regions is not None  # every rank answers for its regions
        return regions

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
        """The sync sources' converted weights' digests, one set: every rank is called (the
        conversion's gathers are collectives), and only sources answer with any."""
        return {name: d for share in self.ranks.all(TrainerRank.converted_digests) for name, d in share.items()}

    def weights_sha256(self) -> str:
        """One SHA256 over the converted (HF) weights: each tensor's SHA256, by name."""
        lines = "".join(f"{name} {digest}\n" for name, digest in sorted(self.converted_digests().items()))
        return hashlib.sha256(lines.encode()).hexdigest()


class ReplicaSet(EngineDefaults):
    """The RolloutEngine Protocol (and the engine's work) over every engine replica: one call
    is made on all of them, and a rollout is split between them in contiguous shares."""

    features = EngineFeatures(footprint=True, reports_weights=True)  # the transformers engine's

    def __init__(self, replicas: WorkerPool[EngineReplica]) -> None:
        self.replicas = replicas
        self.name = "transformers" if len(replicas) == 1 else f"transformers x{len(replicas)}"
        if replicas.remote:
            self.name += " (ray actor)" if len(replicas) == 1 else " (ray actors)"

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self.replicas.all(EngineReplica.release, tags)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self.replicas.all(EngineReplica.resume, tags)

    def state(self) -> EngineState:
        """Every replica's state, in one round trip per replica. Released: the tags every replica
        released (a tag any replica still holds counts as resident, so recover releases it again:
        a no-op, with a note, on the replicas that had). The version every replica serves, None
        while any serves none; replicas that disagree report the oldest, so the guards judge the
        staler one. Idle: every replica is."""
        each = self.replicas.all(EngineReplica.state)
        versions = [s.weight_version for s in each]
        return EngineState(
            released=frozenset.intersection(*(s.released for s in each)),
            idle=all(s.idle for s in each),
            weight_version=None if any(v is None for v in versions) else min(v for v in versions if v is not None),
        )

    def released(self) -> frozenset[EngineMemory]:
        return self.state().released

    def flush_cache(self) -> None:
        self.replicas.all(EngineReplica.flush_cache)

    def weight_version(self) -> int | None:
        return self.state().weight_version

    def is_idle(self) -> bool:
        return self.state().idle

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
