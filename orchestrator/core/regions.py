"""The ledger in front of a `MemoryRegions` adapter: it refuses bad calls before the adapter acts.

torch_memory_saver exits the process on a double pause and ignores CUDA return codes, so nothing
reaches it that the adapter's own account (`paused`, read for the event in flight) says is done
already.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.core.state import Reading
from orchestrator.errors import ConfigError, RegionRefused
from orchestrator.protocols import MemoryRegions
from states import Region


class RegionLedger:
    def __init__(self, regions: MemoryRegions, reading: Callable[[], Reading] | None = None) -> None:
        """`reading`: the event in flight's (a lifecycle's); without one, each call reads the
        regions afresh, as an event of its own."""
        self._regions = regions
        self._reading = reading if reading is not None else lambda: Reading(None, regions, None, None)
        self._tags = frozenset(regions.tags())
        missing = {r.value for r in Region} - self._tags
        if missing:
            raise ConfigError([f"memory regions lack tag {tag!r}" for tag in sorted(missing)])

    @property
    def paused(self) -> frozenset[Region]:
        """What the regions report paused, as the event in flight read them."""
        return self._reading().paused()

    def _known(self, tag: str) -> Region:
        if tag not in self._tags or tag not in Region.__members__.values():
            raise RegionRefused(tag, f"unknown tag; known: {', '.join(r.value for r in Region)}")
        return Region(tag)

    def pause(self, tag: str) -> int:
        region, reading = self._known(tag), self._reading()
        if region in reading.paused():
            raise RegionRefused(tag, "already paused: a second pause would unmap unmapped memory")
        try:
            freed = self._regions.pause(region)
        except BaseException:  # taken effect or not: asked again when next read
            reading.forget("regions")
            raise
        reading.note(region, paused=True)
        return freed

    def resume(self, tag: str) -> int:
        region, reading = self._known(tag), self._reading()
        if region not in reading.paused():
            raise RegionRefused(tag, "not paused: resuming it would map memory over live tensors")
        try:
            retaken = self._regions.resume(region)
        except BaseException:
            reading.forget("regions")
            raise
        reading.note(region, paused=False)
        return retaken
