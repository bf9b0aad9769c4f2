"""The job's measured memory budget (`job.memory`): region bytes from the ranks once, the engine's
footprint, and the least free memory of the ranks' GPUs read anew for every snapshot."""

from __future__ import annotations

from orchestrator.core.offload import choose
from orchestrator.job.memory import MeasuredMemory
from states import EngineMemory, Offload, Region

GB = 10**9


class _Ranks:
    def __init__(self) -> None:
        self.free = [40 * GB, 30 * GB]
        self.asked = 0
        self.moments_to_come = 0

    def region_bytes(self) -> dict[str, int]:
        return {"param_buffer": 2 * GB, "grad_buffer": 4 * GB, "default": 12 * GB}

    def device_memory(self) -> list[tuple[int, int]]:
        self.asked += 1
        return [(f, 80 * GB) for f in self.free]

    def unallocated_bytes(self) -> int:
        return self.moments_to_come


ENGINE = {EngineMemory.WEIGHTS: 2 * GB, EngineMemory.KV_CACHE: 10 * GB, EngineMemory.CUDA_GRAPH: 0}


def test_the_budget_reads_the_least_free_gpu_each_time() -> None:
    ranks = _Ranks()
    memory = MeasuredMemory(ranks, ENGINE)
    assert memory().device_free == 30 * GB
    ranks.free = [5 * GB, 9 * GB]
    budget = memory()
    assert budget.device_free == 5 * GB and ranks.asked == 2
    assert budget.regions[Region.DEFAULT] == 12 * GB and budget.engine[EngineMemory.KV_CACHE] == 10 * GB


def test_auto_keeps_what_the_rollout_fits_beside() -> None:
    ranks = _Ranks()
    roomy = choose(Offload.AUTO, MeasuredMemory(ranks, ENGINE)())
    assert roomy.keep == {Region.DEFAULT, Region.GRAD_BUFFER}
    # 1 GB free: the rollout's 12 GB fit only where the state (12 GB) and the params (2 GB) leave;
    # the grads (4 GB) can stay.
    ranks.free = [1 * GB, 1 * GB]
    tight = choose(Offload.AUTO, MeasuredMemory(ranks, ENGINE)())
    assert tight.keep == {Region.GRAD_BUFFER}


def test_memory_the_adam_moments_will_take_is_not_free_before_the_first_step() -> None:
    ranks = _Ranks()
    ranks.moments_to_come = 8 * GB  # the optimizer has not stepped yet
    memory = MeasuredMemory(ranks, ENGINE)
    assert memory().device_free == 30 * GB - 8 * GB
    ranks.moments_to_come = 0  # the first step made them: the GPU's free count now says it all
    assert memory().device_free == 30 * GB
    ranks.moments_to_come = 99 * GB  # no longer asked once they were all there
    assert memory().device_free == 30 * GB
