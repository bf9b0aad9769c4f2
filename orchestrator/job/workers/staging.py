"""Weights from a rank to the engine replica on its GPU, by CUDA IPC through a staging buffer.

torch shares CUDA tensors between processes with legacy CUDA IPC (`cudaIpcGetMemHandle`), which
works only on memory from `cudaMalloc`. The rank's params live in torch_memory_saver regions,
mapped with the virtual memory API (cuMemCreate + cuMemMap), and sharing them fails with
"invalid argument" (seen on an H200 with torch_memory_saver 0.0.10). So each rank allocates one
plain buffer outside every region, shares its handle with its replica once, and each push packs
the converted tensors into it: one device copy on the rank, one into the params on the replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from orchestrator.adapters.transport.bucketed import nbytes
from orchestrator.protocols import Named

ALIGN = 256  # bytes: every slot starts aligned for any dtype's view


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lies in the staging buffer."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


class LoadsStaged(Protocol):
    """What a staged push needs of the replicas (`fanout.ReplicaSet`): replica `index` loads
    `slots` of the buffer it attached, as weights of `version`, and returns the bytes it wrote."""

    def load_staged(self, index: int, slots: Sequence[Slot], version: int) -> int: ...


class StagingBuffer:
    """A rank's plain device buffer of `capacity` bytes, shared with its replica by CUDA IPC."""

    def __init__(self, capacity: int) -> None:
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device="cuda")

    def handle(self) -> Any:
        """What `attach` rebuilds in another process on the same GPU (torch's own reduction)."""
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(self.buffer)

    def sink(self, replicas: LoadsStaged, index: int) -> StagedSink:
        return StagedSink(self.buffer, replicas, index)


def attach(handle: Any) -> torch.Tensor:
    """The staging buffer another process shared (`StagingBuffer.handle`)."""
    rebuild, args = handle
    return rebuild(*args)


class StagedSink:
    """A `BucketSink`: packs each bucket into the staging buffer, then has replica `index` load
    it. A bucket larger than the buffer goes in several loads."""

    def __init__(self, buffer: torch.Tensor, replicas: LoadsStaged, index: int) -> None:
        self.buffer, self.replicas, self.index = buffer, replicas, index

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        slots: list[Slot] = []
        offset = sent = 0
        for name, tensor in named:
            size = nbytes(tensor)
            if slots and offset + size > self.buffer.numel():
                sent += self._load(slots, version)
                slots, offset = [], 0
            slot = Slot(name, offset, tuple(tensor.shape), tensor.dtype)
            slot.view(self.buffer).copy_(tensor)
            slots.append(slot)
            offset += -(-size // ALIGN) * ALIGN
        return sent + (self._load(slots, version) if slots else 0)

    def _load(self, slots: list[Slot], version: int) -> int:
        torch.cuda.current_stream().synchronize()  # the bytes are in place before the replica reads them
        return self.replicas.load_staged(self.index, slots, version)
