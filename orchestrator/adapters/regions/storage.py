"""Storage-level memory regions: a paused tensor's storage is really freed, and reallocated at resume.

Megatron's params are views of one `param_data` tensor per DDP buffer, so resizing that
storage to zero frees every param at once and resizing it back revives every view (Megatron's
own `offload_to_cpu` works the same way). Contents are lost, except for tags in
`keep_contents`, which are copied to host memory first: that is the `default` region, which
holds the fp32 mains and Adam moments. From a GPU they go to a `HostArena` pinned once and kept
across cycles; on the CPU to a copy made at the pause and dropped at the resume, since a copy
kept in the same RAM would only double what the region holds.

Works on CPU and GPU. On the GPU the freed blocks return to PyTorch's caching allocator, which
this hands back to the device (`empty_cache`); addresses change on resume, unlike
torch_memory_saver's (`tms.py`).

What `pause` counts as freed, per region, is what the memory the storages live in got back:

- `param_buffer`, `grad_buffer`: every byte of their storages (no copy is kept);
- `default` on a GPU: every byte, since its copy goes to host memory;
- `default` on the CPU: nothing, since its copy is made in the same RAM. The pause still
  happens (the contents go out and come back, as on a GPU), but it frees no memory.

`resume` counts the same way: what the storages' memory had to give back.

`paused` is what this adapter did, storage by storage: a storage counts as paused the moment
it is freed, and stays paused until its memory and contents are back. So a pause that raised
midway (a host copy that failed on the second storage) leaves its tag paused, holding what it
freed, and a resume that raised midway (a `resize_` out of memory) leaves it paused until a
later resume has retaken the rest. Pausing a paused tag, or resuming a resident one, does
nothing but note it (`note_noop`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from orchestrator.adapters.regions.host import HostArena, as_bytes
from orchestrator.protocols import RegionsStateFromReads
from orchestrator.telemetry.logs import note_noop
from states import Region

TensorsByTag = Mapping[str, Sequence[torch.Tensor]]


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def return_large_frees_to_the_os(threshold: int = 1 << 20) -> None:
    """Serve every host allocation of `threshold` bytes or more from its own mapping.

    glibc otherwise raises its mmap threshold after the first large free, so a storage resized
    back later lands in the heap and freeing it again returns nothing to the OS. A fixed
    threshold turns that adjustment off (process-wide; only on glibc).
    """
    if sys.platform != "linux" or (libc := ctypes.util.find_library("c")) is None:
        return
    ctypes.CDLL(libc).mallopt(_M_MMAP_THRESHOLD, threshold)


def storages_by_tag(tensors: TensorsByTag) -> dict[str, list[torch.UntypedStorage]]:
    """Each live storage once, under the first tag (in `Region` order) that names it."""
    seen: set[int] = set()
    result: dict[str, list[torch.UntypedStorage]] = {}
    for region in Region:
        result[region.value] = []
        for tensor in tensors.get(region.value, ()):
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                result[region.value].append(storage)
    return result


@dataclass
class _Paused:
    storage: torch.UntypedStorage
    nbytes: int
    backup: torch.Tensor | None

    @property
    def freed(self) -> int:
        """Bytes the storage's memory got back: none where the backup lives in that same memory."""
        same_memory = self.backup is not None and self.backup.device == self.storage.device
        return 0 if same_memory else self.nbytes


class StorageRegions(RegionsStateFromReads):
    """Implements `orchestrator.protocols.MemoryRegions` by resizing storages.

    `tensors` is called at every pause, so tensors created after construction (Adam's moments
    made by a first step, where set-up did not make them) are paused too.
    """

    def __init__(
        self, tensors: Callable[[], TensorsByTag], *, keep_contents: Collection[str] = (Region.DEFAULT.value,)
    ) -> None:
        self._tensors = tensors
        self._keep = frozenset(keep_contents)
        self._paused: dict[str, list[_Paused]] = {}  # the storages freed, by tag
        self._saved: dict[str, list[torch.UntypedStorage]] = {}  # what each arena holds, while paused
        self._arenas: dict[str, HostArena] = {}
        return_large_frees_to_the_os()

    def tags(self) -> frozenset[str]:
        return frozenset(r.value for r in Region)

    @property
    def paused(self) -> frozenset[str]:
        """The tags holding a storage this adapter freed and has not yet restored."""
        return frozenset(self._paused)

    def pause(self, tag: str) -> int:
        """Free the tag's storages (copying `keep_contents` tags to host memory first); returns
        the bytes their memory got back (see the module docstring). A paused tag: 0, a note."""
        if tag in self._paused:
            note_noop("storage regions", f"pause({tag})", "already paused")
            return 0
        storages = storages_by_tag(self._tensors())[tag]
        to_arena = tag in self._keep and any(s.device.type == "cuda" for s in storages)
        if to_arena:  # every byte is on the host before the first storage is freed
            self._arenas.setdefault(tag, HostArena(pinned=True)).save(storages)
        paused: list[_Paused] = []
        try:
            for storage in storages:
                backup = None
                if tag in self._keep and not to_arena:
                    backup = torch.empty(storage.nbytes(), dtype=torch.uint8)
                    backup.copy_(as_bytes(storage))
                nbytes = storage.nbytes()
                storage.resize_(0)
                paused.append(_Paused(storage, nbytes, backup))
        finally:  # what was freed is paused, even if a later storage raised
            if paused or not storages:
                self._paused[tag] = paused
                if to_arena:
                    self._saved[tag] = storages
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return sum(p.freed for p in paused)

    def resume(self, tag: str) -> int:
        """Reallocate the tag's freed storages and copy back what `keep_contents` kept; returns
        the bytes retaken by this call. The tag is resident only once every storage and its
        contents are back: after a `resize_` that raised, a second resume retakes the rest.
        A resident tag: 0, a note."""
        paused = self._paused.get(tag)
        if paused is None:
            note_noop("storage regions", f"resume({tag})", "not paused")
            return 0
        retaken = 0
        for p in paused:
            if p.storage.nbytes() != p.nbytes:  # else an earlier resume retook it before it raised
                p.storage.resize_(p.nbytes)
                retaken += p.freed
        for p in paused:
            if p.backup is not None:
                as_bytes(p.storage).copy_(p.backup)
        if tag in self._saved:
            self._arenas[tag].load(self._saved[tag])
        del self._paused[tag]
        self._saved.pop(tag, None)
        return retaken

    def host_arena_bytes(self) -> int:
        """Pinned host bytes the arenas hold (GPU storages only), kept across cycles."""
        return sum(arena.nbytes for arena in self._arenas.values())

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each tag holds now (0 while paused)."""
        return {tag: sum(s.nbytes() for s in storages) for tag, storages in storages_by_tag(self._tensors()).items()}
