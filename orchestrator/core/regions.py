"""The ledger in front of a `MemoryRegions` adapter: it refuses bad calls before the adapter acts.

torch_memory_saver exits the process on a double pause and ignores CUDA return codes, so nothing
reaches it that the adapter's own account (`paused`) says is done already.
"""

from __future__ import annotations

from orchestrator.errors import ConfigError, RegionRefused
from orchestrator.protocols import KeepsHostArena, MemoryRegions
from states import Region


class RegionLedger:
    def __init__(self, regions: MemoryRegions) -> None:
        self._regions = regions
        self._tags = frozenset(regions.tags())
        missing = {r.value for r in Region} - self._tags
        if missing:
            raise ConfigError([f"memory regions lack tag {tag!r}" for tag in sorted(missing)])

    def host_arena_bytes(self) -> int:
        """What the adapter pins for its regions' contents (0 for one that pins nothing)."""
        return self._regions.host_arena_bytes() if isinstance(self._regions, KeepsHostArena) else 0

    @property
    def paused(self) -> frozenset[Region]:
        """What the adapter says is paused now (a pause that raised after it took effect counts)."""
        return frozenset(Region(tag) for tag in self._regions.paused if tag in Region.__members__.values())

    def _known(self, tag: str) -> Region:
        if tag not in self._tags or tag not in Region.__members__.values():
            raise RegionRefused(tag, f"unknown tag; known: {', '.join(r.value for r in Region)}")
        return Region(tag)

    def pause(self, tag: str) -> int:
        region = self._known(tag)
        if region in self.paused:
            raise RegionRefused(tag, "already paused: a second pause would unmap unmapped memory")
        return self._regions.pause(region)

    def resume(self, tag: str) -> int:
        region = self._known(tag)
        if region not in self.paused:
            raise RegionRefused(tag, "not paused: resuming it would map memory over live tensors")
        return self._regions.resume(region)
