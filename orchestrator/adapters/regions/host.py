"""The host side of a paused region that keeps its contents: one arena, pinned once, reused every cycle.

Pinning is what makes a host copy slow, not the copy: on an H200, `pin_memory()` of 8 GiB took
3.5 s, while a copy into memory already pinned ran at 50–51 GiB/s each way. torch_memory_saver's
own CPU backup pins a fresh shadow at every pause (`cudaMallocHost` when its slot is empty) and
frees it at every resume unless `retain_cpu_backup` is set, and that switch is process-wide: it
would keep every region's shadow of every library in the process. So the regions adapters keep
their own arena, sized to the region's storages and pinned once, and count it.

The arena is laid out by the storages it shadows (each one's identity and size), at set-up
(`lay_out`) where the regions adapter knows them. A change of that set (Adam's moments made by a
first step, where set-up did not make them) lays it out anew: the old arena is freed before the
new one is made, so the host never holds both. In steady state nothing is
allocated or pinned; `save` and `load` only copy, in chunks, on a stream of their own.

Pinning is `cudaHostRegister` over plain host memory, not torch's pinned allocator, which rounds
every block up to a power of two.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import nullcontext

import torch

CHUNK_BYTES = 64 << 20  # one copy command per chunk: bounded, and long enough to run at the link's rate
_PAGE = 4096


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _key(storage: torch.UntypedStorage) -> tuple[int, int]:
    """A storage's identity (its StorageImpl, which `resize_` keeps) and its size."""
    return storage._cdata, storage.nbytes()


def _unpin(block: torch.Tensor) -> None:
    """Unregister `block`; the finalizer holds it, so it is freed only after this."""
    torch.cuda.cudart().cudaHostUnregister(block.data_ptr())


class HostArena:
    """Host copies of one region's device storages, in one block pinned once.

    `pinned=False` (no CUDA) gives a plain host block: the same layout and copies, for tests.
    """

    def __init__(self, *, pinned: bool, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._pinned, self._chunk = pinned, chunk_bytes
        self._layout: tuple[tuple[int, int], ...] = ()
        self._block: torch.Tensor | None = None
        self._offsets: list[int] = []
        self._release: weakref.finalize | None = None
        # Made now, not at the first pause: the first stream a process takes sets up torch's pool
        # of streams, 70 MiB of device memory on an H200 (measured), which no pause should count.
        self._stream = torch.cuda.Stream() if pinned else None
        self.layouts = 0  # how many times the arena was laid out (allocated and pinned)

    @property
    def nbytes(self) -> int:
        """Host bytes the arena holds now (pinned when `pinned`)."""
        return 0 if self._block is None else self._block.numel()

    def save(self, storages: Sequence[torch.UntypedStorage]) -> int:
        """Copy each storage's bytes into the arena (laid out anew if the storages changed).
        Returns the bytes copied; they are on the host when this returns."""
        self._fit(storages)
        self._copy(storages, to_host=True)
        return sum(s.nbytes() for s in storages)

    def load(self, storages: Sequence[torch.UntypedStorage]) -> int:
        """Copy the arena back into the same storages `save` was given. Returns the bytes copied.

        On a GPU this returns once the copy is queued: the current stream waits for it, so every
        kernel queued after (the restore's cast reads the mains) sees the bytes, while the host
        goes on (maps the next region) during the copy."""
        if tuple(_key(s) for s in storages) != self._layout:
            raise RuntimeError("host arena: load of storages other than the ones saved")
        self._copy(storages, to_host=False)
        return sum(s.nbytes() for s in storages)

    def close(self) -> None:
        """Unpin and free the arena."""
        if self._release is not None:
            self._release()
        self._block, self._release, self._layout, self._offsets = None, None, (), []

    def lay_out(self, storages: Sequence[torch.UntypedStorage]) -> None:
        """Allocate and pin the arena for `storages` now (as `save` would at its first call), so
        that no pause pays for it. Nothing is copied."""
        self._fit(storages)

    def _fit(self, storages: Sequence[torch.UntypedStorage]) -> None:
        layout = tuple(_key(s) for s in storages)
        if layout == self._layout:
            return
        self.close()  # the old block goes before the new one is made: never both on the host
        offsets, total = [], 0
        for _, size in layout:
            offsets.append(total)
            total += -(-size // _PAGE) * _PAGE
        raw = torch.empty(total + _PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE
        block = raw[start : start + total]
        if self._pinned and total:
            # Touch every page first, on torch's threads: registering untouched pages faults
            # them in one at a time (2.6 GB/s on an H200's host, 1 to 16 threads alike), while
            # touching, then registering, took 0.75 + 0.73-0.88 s for 16 GB (issue 40).
            block.zero_()
            err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), total, 0)
            if int(err) != 0:
                raise RuntimeError(f"host arena: cudaHostRegister of {total:,} bytes failed ({err})")
            self._release = weakref.finalize(self, _unpin, block)  # at close(), or when the arena goes
        self._block, self._offsets, self._layout = block, offsets, layout
        self.layouts += 1

    def _copy(self, storages: Sequence[torch.UntypedStorage], *, to_host: bool) -> None:
        if self._block is None:
            return
        on_device = bool(storages) and storages[0].device.type == "cuda"
        stream = self._stream if on_device else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))  # the device's writes land first
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for storage, offset in zip(storages, self._offsets, strict=True):
                device, size = as_bytes(storage), storage.nbytes()
                host = self._block[offset : offset + size]
                for start in range(0, size, self._chunk):
                    end = min(start + self._chunk, size)
                    if to_host:
                        host[start:end].copy_(device[start:end], non_blocking=on_device)
                    else:
                        device[start:end].copy_(host[start:end], non_blocking=on_device)
        if stream is None:
            return
        if to_host:
            stream.synchronize()  # the bytes are on the host before the device memory is unmapped
        else:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
