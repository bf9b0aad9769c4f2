"""The job's memory budget on GPUs, measured rather than planned: what the memory-budget guard and
`--offload auto` read.

Each region's bytes come from the ranks (the buffers as built, the optimizer state as Adam's once it
has stepped), the engine's from its own settings (its weights and KV cache), and the free memory
from the GPUs, read anew for each snapshot: the least free of the ranks' GPUs, since every rank
moves the same regions at the same time. Until the optimizer's first step its moments are not
allocated, so what they will take is not free: it is taken off, until the ranks hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from states import EngineMemory, MemoryBudget, Region


class _Ranks(Protocol):
    def region_bytes(self) -> dict[str, int]: ...

    def device_memory(self) -> list[tuple[int, int]]: ...

    def unallocated_bytes(self) -> int: ...


class MeasuredMemory:
    """A `LifecycleConfig.memory` for the job: fixed bytes per tag, free memory read per call."""

    __slots__ = ("_ranks", "_until_allocated", "engine", "regions")

    def __init__(self, ranks: _Ranks, engine: Mapping[EngineMemory, int]) -> None:
        self._ranks = ranks
        self.regions = {Region(tag): n for tag, n in ranks.region_bytes().items()}
        self.engine = dict(engine)
        self._until_allocated = True  # asked until the ranks hold all their regions will

    def __call__(self) -> MemoryBudget:
        free = min(f for f, _ in self._ranks.device_memory())
        if self._until_allocated:
            pending = self._ranks.unallocated_bytes()
            self._until_allocated = pending > 0
            free -= pending
        return MemoryBudget(device_free=free, regions=self.regions, engine=self.engine, source="the ranks' GPUs")
