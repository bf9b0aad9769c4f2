"""torch_memory_saver regions (GPU): pause unmaps the physical pages, resume maps fresh ones at
the same virtual addresses, so every pointer into a paused tensor stays valid.

Megatron allocates each DDP buffer's `param_data` and `grad_data` in one constructor, so no
`region()` context can tag them apart. Instead of patching Megatron, `TorchMemorySaverRegions`
re-homes their storages after construction: it frees each storage and reallocates it (same
size, same storage object, so every param view follows) inside `region(tag)`, where
torch_memory_saver's `hook_mode="torch"` pool serves the allocation. The optimizer state is
re-homed into `default` with a CPU backup, so its contents survive a pause. Storages that
appear later (Adam moments, at the first optimizer step) are re-homed at the next pause.

torch_memory_saver ends the process on a pause of a paused tag or a resume of a resident one, so
this adapter never passes either on: it keeps which tags it paused (`paused`) and makes both a
no-op with a note (`note_noop`). A tag counts as paused from the moment torch_memory_saver's
pause returned (its pages are unmapped then) until its pages are mapped again and the bytes it
keeps are back: a resume that raised midway leaves it paused, and the next resume finishes it.

Import order: Megatron sets `torch_memory_saver.hook_mode = "torch"` when its inference context
is imported, which fails once torch_memory_saver is initialised, so Megatron is imported first.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable
from typing import Any

import torch

from orchestrator.adapters.regions.host import HostArena, as_bytes
from orchestrator.adapters.regions.storage import TensorsByTag, storages_by_tag
from orchestrator.protocols import RegionsStateFromReads
from orchestrator.telemetry.logs import note_noop
from states import Region

_KEEP_CONTENTS = frozenset({Region.DEFAULT.value})
_REHOME_MARGIN = 1 << 30  # free device bytes a re-homing leaves beside its device copy


def _saver() -> Any:
    with contextlib.suppress(ImportError):  # megatron first: it configures hook_mode itself on import
        importlib.import_module("megatron.core.inference.contexts.dynamic_context")
    from torch_memory_saver import torch_memory_saver

    if getattr(torch_memory_saver, "_impl", None) is None:
        torch_memory_saver.hook_mode = "torch"
    return torch_memory_saver


def _free_device_bytes() -> int:
    """The driver's count: torch_memory_saver maps and unmaps synchronously, so no device sync is
    needed, and none is made (it would wait for the arena's copy back, which overlaps the next map)."""
    return torch.cuda.mem_get_info()[0]


class TorchMemorySaverRegions(RegionsStateFromReads):
    """Implements `orchestrator.protocols.MemoryRegions` on torch_memory_saver.

    `tensors` is called at construction and before every pause: each storage it names is
    re-homed once, the first time it is seen (`_rehome`: a copy of its bytes). Bytes reported
    are the device's free memory before and after, as the driver sees them. `close()` frees the
    host arenas; pausing after it pins them again.
    """

    def __init__(self, tensors: Callable[[], TensorsByTag]) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("torch_memory_saver needs a CUDA device; use StorageRegions on the CPU")
        self._tms = _saver()
        self._tensors = tensors
        self._homed: set[int] = set()  # data_ptr of re-homed storages: stable across pause and resume
        self._arenas = {tag: HostArena(pinned=True) for tag in _KEEP_CONTENTS}
        self._saved: dict[str, list[torch.UntypedStorage]] = {}  # what each arena holds, while paused
        self._unmapped: set[str] = set()  # the tags torch_memory_saver holds paused
        self._rehome_new()
        self._lay_out_arenas()

    def _lay_out_arenas(self) -> None:
        """Lay out and pin each arena now, at set-up, for the storages its tag holds: with Adam's
        state made at set-up (`build.init_optimizer_state`) they are final, and no pause of any
        step pins. `arena_setup`: the bytes pinned and the seconds it took (the job's `rank.setup`
        span carries them)."""
        start, by_tag = time.perf_counter(), storages_by_tag(self._tensors())
        for tag, arena in self._arenas.items():
            arena.lay_out(by_tag[tag])
        self.arena_setup = (self.host_arena_bytes(), time.perf_counter() - start)

    def _rehome_new(self) -> None:
        moved = False
        for tag, storages in storages_by_tag(self._tensors()).items():
            for storage in storages:
                if storage.data_ptr() not in self._homed:
                    self._rehome(storage, tag)
                    moved = True
        if moved:
            torch.cuda.empty_cache()  # the pre-re-homing blocks go back to the device

    def _rehome(self, storage: torch.UntypedStorage, tag: str) -> None:
        """Its bytes wait in a copy while the storage is freed and made again inside the region: a
        copy on the device where one fits beside the new pages (a device copy's rate), else on the
        host (the pageable rate: 48 GB of Adam's state took tens of seconds that way)."""
        nbytes = storage.nbytes()
        on_device = _free_device_bytes() >= nbytes + _REHOME_MARGIN
        kept = as_bytes(storage).clone() if on_device else as_bytes(storage).cpu()
        storage.resize_(0)
        if on_device:
            torch.cuda.empty_cache()  # the old pages go back to the driver, which the region's are taken from
        with self._tms.region(tag=tag, enable_cpu_backup=False):
            storage.resize_(nbytes)
        as_bytes(storage).copy_(kept)
        self._homed.add(storage.data_ptr())

    def tags(self) -> frozenset[str]:
        return frozenset(r.value for r in Region)

    @property
    def paused(self) -> frozenset[str]:
        """The tags torch_memory_saver holds unmapped, and those whose kept bytes are not back
        yet (a resume that mapped the pages, then raised before the arena's copy)."""
        return frozenset(self._unmapped | self._saved.keys())

    def pause(self, tag: str) -> int:
        """Unmap the tag's pages (`default`'s bytes go to the host arena first); returns the bytes
        the device got back. A paused tag: 0 and a note, never torch_memory_saver's exit."""
        if tag in self.paused:
            note_noop("torch_memory_saver regions", f"pause({tag})", "already paused")
            return 0
        self._rehome_new()
        torch.cuda.synchronize()  # nothing queued may still touch memory about to be unmapped
        before = _free_device_bytes()
        kept = storages_by_tag(self._tensors())[tag] if tag in self._arenas else None
        if kept is not None:
            self._arenas[tag].save(kept)
        self._tms.pause(tag)
        self._unmapped.add(tag)
        if kept is not None:
            self._saved[tag] = kept
        return _free_device_bytes() - before

    def resume(self, tag: str) -> int:
        """Map fresh pages at the same addresses (`default`'s bytes come back from the arena);
        returns the bytes retaken. A resident tag: 0 and a note, never torch_memory_saver's exit.
        After a resume that raised, a second one does what the first left undone."""
        if tag not in self.paused:
            note_noop("torch_memory_saver regions", f"resume({tag})", "not paused")
            return 0
        before = _free_device_bytes()
        if tag in self._unmapped:
            self._tms.resume(tag)
            self._unmapped.discard(tag)
        retaken = before - _free_device_bytes()
        if tag in self._saved:  # queued: the current stream waits for it (HostArena.load)
            self._arenas[tag].load(self._saved[tag])
            del self._saved[tag]
        return retaken

    def host_arena_bytes(self) -> int:
        """Pinned host bytes the arenas hold: kept across cycles, so the same in every phase."""
        return sum(arena.nbytes for arena in self._arenas.values())

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
