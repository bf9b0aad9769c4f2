"""`DistributedTrainer` says what is true on any rank: two in-process ranks, each with its own
real `StorageRegions`. The ranks are `TrainerRank`s built without Megatron (its process group is
one per process): their `pause`, `resume`, `paused` and `mains_generation` are the real methods,
over storage regions and an in-memory trainer."""

from __future__ import annotations

import torch

from orchestrator.adapters.regions.storage import StorageRegions
from orchestrator.job.workers.facades import DistributedTrainer
from orchestrator.job.workers.pool import WorkerPool
from orchestrator.job.workers.trainer_rank import TrainerRank
from orchestrator.protocols import MemoryRegions
from orchestrator.testing import InMemoryTrainer
from states import Region

GRADS = Region.GRAD_BUFFER.value


def ranks(count: int) -> DistributedTrainer:
    workers = []
    for index in range(count):
        rank = TrainerRank.__new__(TrainerRank)  # no process group, no model: only what these calls read
        rank.rank, rank.trainer = index, InMemoryTrainer()
        tensors = {GRADS: [torch.ones(256)], Region.PARAM_BUFFER.value: [], Region.DEFAULT.value: []}
        rank.regions = StorageRegions(lambda tensors=tensors: tensors)
        workers.append(rank)
    return DistributedTrainer(WorkerPool(workers, label="rank", remote=False))


def test_a_tag_paused_on_any_rank_is_paused_and_resume_on_every_rank_is_safe() -> None:
    trainer = ranks(2)
    assert isinstance(trainer, MemoryRegions)
    first, second = trainer.ranks.workers
    first.pause(GRADS)  # a fan-out that stopped after rank 0
    assert trainer.paused == {GRADS}
    assert trainer.resume(GRADS) == 1024, "rank 0 retook its grads; rank 1's resume was a no-op"
    assert trainer.paused == frozenset()
    assert second.regions.paused == frozenset() and first.regions.paused == frozenset()


def test_a_step_begun_on_any_rank_moves_the_generation() -> None:
    trainer = ranks(2)
    assert trainer.mains_generation() == 0
    trainer.ranks.workers[1].trainer.move_mains()  # rank 1 began a step, rank 0 did not
    assert trainer.mains_generation() == 1
