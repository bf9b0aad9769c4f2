"""From a plan to the `MemoryBudget` each snapshot carries: the plan's bytes and what is free.

    probe = MemoryProbe.for_plan(plan, stage=0)               # free memory from the driver
    probe = MemoryProbe.for_plan(plan, stage=0, limit=80e9)   # an explicit device budget
    LifecycleConfig(memory=probe, ...)

`for_plan` also checks the host at init: the pinned backup of the plan's mode must fit in the
host's available memory, or it raises ConfigError naming both numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from guards.memory import host_backup_fits
from orchestrator.errors import ConfigError
from orchestrator.plan.memory import Plan
from states import EngineMemory, MemoryBudget, Region


def cuda_free(device: int | None = None) -> Callable[[], int]:
    """Free bytes on a CUDA device as the driver counts them (other processes' memory included)."""

    def read() -> int:
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)

    return read


def host_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


class MemoryProbe:
    """Called by the lifecycle for each snapshot; its bytes per tag are fixed, `free` is read anew."""

    __slots__ = ("_free", "_limit", "engine", "regions", "source")

    def __init__(
        self,
        *,
        regions: dict[Region, int],
        engine: dict[EngineMemory, int],
        free: Callable[[], int] | None = None,
        limit: int | None = None,
        source: str = "budget",
    ) -> None:
        if (free is None) == (limit is None):
            raise ConfigError(["a memory probe reads free memory or takes a limit: give exactly one"])
        self.regions, self.engine, self.source = dict(regions), dict(engine), source
        self._free, self._limit = free, limit

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        *,
        stage: int = 0,
        limit: int | None = None,
        device: int | None = None,
        host_free: int | None = None,
    ) -> MemoryProbe:
        """The probe for one rank of `stage`. Without `limit`, free memory comes from CUDA.

        `host_free` (default: the host's available memory) must hold what the rank pins: the mode's
        backup and the host arena of the optimizer state where it moves.
        """
        rank = plan.ranks[stage]
        available = host_available() if host_free is None else host_free
        # The mode's backup and, where `default` moves, the host arena kept for it: the host's peak.
        verdict = host_backup_fits(max(host for _, host in plan.phases(rank).values()), available)
        if not verdict.ok:
            raise ConfigError([verdict])
        regions, engine = plan.region_bytes(rank), plan.engine_bytes()
        if limit is not None:
            return cls(regions=regions, engine=engine, limit=int(limit), source=f"a {limit / 1e9:.2f} GB budget")
        where = f"cuda:{device}" if device is not None else "the current CUDA device"
        return cls(regions=regions, engine=engine, free=cuda_free(device), source=where)

    def __call__(self) -> MemoryBudget:
        free = self._free() if self._free is not None else None
        return MemoryBudget(
            device_free=free, device_limit=self._limit, regions=self.regions, engine=self.engine, source=self.source
        )
