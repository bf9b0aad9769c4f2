"""Frozen views that guards read: the lifecycle's snapshot and the trainer's layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from states.phases import EngineMemory, Mode, Phase, Region, Source


def _frozen(mapping: Mapping[str, Source]) -> Mapping[str, Source]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerLayout:
    """Where every named tensor of the trainer lives, computed once at init.

    `sync_sources` names each tensor the weight sync hands out and where it reads it from;
    `uncovered` names parameters that neither the cast + all-gather nor the extras backup can
    bring back after the param buffer is dropped.
    """

    sync_sources: Mapping[str, Source] = field(default_factory=dict)
    uncovered: tuple[str, ...] = ()
    param_bytes: int = 0  # bf16 bytes of this rank's params: what backup mode pins
    params: int = 0  # elements of every param of this rank
    extras_bytes: int = 0  # what rematerialize mode pins

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync_sources", _frozen(self.sync_sources))

    def __deepcopy__(self, memo: dict[int, object]) -> TrainerLayout:
        return self  # immutable all the way down


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBudget:
    """What the memory planner predicts each region and engine tag takes on this rank's device,
    and what is free there: `device_free` as read just before the event (the driver's count),
    or, given `device_limit` instead, the limit less what the plan says is resident now.
    """

    device_free: int | None = None
    device_limit: int | None = None
    regions: Mapping[Region, int] = field(default_factory=dict)  # trainer bytes per region tag
    engine: Mapping[EngineMemory, int] = field(default_factory=dict)  # engine bytes per tag
    source: str = "budget"  # where device_free came from: "cuda:0", "budget", ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", MappingProxyType(dict(self.regions)))
        object.__setattr__(self, "engine", MappingProxyType(dict(self.engine)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """Everything a guard may look at, taken just before an event is admitted."""

    phase: Phase
    mode: Mode
    step: int
    paused: frozenset[Region]
    engine_attached: bool
    engine_resident: frozenset[EngineMemory]
    engine_idle: bool
    engine_synced: bool  # the engine now attached has received at least one sync
    engine_version: int | None  # what the engine reports serving
    weight_version: int  # the last version colocate pushed; 0 before the first sync
    cache_flushed: bool  # no cache entry computed with older weights survives
    trained_since_sync: bool  # an optimizer step ran since the last sync
    extras_stashed: bool  # the extras backup holds this step's values
    params_valid: bool  # the params are cast(mains) now: seen so since the mains last moved
    layout: TrainerLayout
    memory: MemoryBudget | None = None  # None: no plan given, the memory guard admits
    # The regions the offload choice keeps on the device through the rollout: never paused, so
    # never in `paused`, and counted by the memory guard as resident in every phase.
    kept: frozenset[Region] = frozenset()

    @property
    def param_buffer_resident(self) -> bool:
        return Region.PARAM_BUFFER not in self.paused
