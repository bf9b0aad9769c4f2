"""SGLang's wire format for weights: the flattened bucket and its serialization.

Serialization is SGLang's `MultiprocessingSerializer` wire format, reimplemented here without
importing sglang: `ForkingPickler` (torch's tensor reductions: CUDA IPC handles on GPU, shared
memory files on CPU), then standard base64, one payload per TP rank (each rank unpickles only
its own, which keeps CUDA IPC refcounts right; a payload names the memory of the process that
serialized it). CPU storages go by shared-memory file *name*
(what torch's `file_system` strategy sends), chosen by the pickler, never by the process-wide
strategy: torch's default passes a file descriptor through multiprocessing's resource sharer,
which answers only processes holding the sender's authkey, and a server is no child of the
trainer (see `_Pickler`). As SGLang's patched reductions do,
a CUDA tensor's device index is replaced by the device UUID, so trainer and engine need not agree
on device numbering; SGLang's receiver patches `rebuild_cuda_tensor` to accept it.
"""

from __future__ import annotations

import base64
import io
import os
import threading
import types
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

import torch
from torch.multiprocessing import reductions  # importing it registers torch's reductions with ForkingPickler

from orchestrator.protocols import Named

T = TypeVar("T")

_CUDA_DEVICE_ARG = 6  # index of `device` in torch's reduce_tensor args for CUDA tensors (SGLang's patch_torch)


class _Pickler(ForkingPickler):
    """ForkingPickler with SGLang's wire choices, decided per pickler, never per process.

    - A CUDA tensor carries its device UUID where torch puts the device index, as sglang's
      `patch_torch` does.
    - A CPU storage goes by shared-memory file *name* (what torch's `file_system` strategy sends),
      whatever `torch.multiprocessing`'s process-wide strategy is: the default (`file_descriptor`)
      passes a descriptor through multiprocessing's resource sharer, which answers only processes
      holding this process's authkey, and a server is no child of the trainer. Setting the strategy
      around each call instead would race: `SGLangGroup` pickles for several servers at once from
      threads, and one thread restored the strategy while another was still pickling.
    - Tensors are reduced by torch's own `reduce_tensor`, whatever ForkingPickler's process-wide
      table holds: sglang's `monkey_patch_torch_reductions` replaces it there with a version that
      fails on CPU tensors, which matters where both live in one process (the contract tier).
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            rebuild, args = _torch_reduce_tensor(obj)
            if not obj.is_cuda:
                return rebuild, args
            uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
            return rebuild, (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu":
            return _reduce_storage_by_name(obj)
        return NotImplemented


# torch's tensor reduction, as torch defines it (sglang keeps the original under this name when it patches).
_torch_reduce_tensor = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """torch's `reduce_storage` under the `file_system` strategy, for this storage only."""
    _start_shm_manager_quietly()
    metadata = patiently(storage._share_filename_cpu_)
    storage._shared_incref()  # the receiver's rebuild decrefs, as with torch's own reduction
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), *metadata)


_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
_MANAGER_ATTEMPTS = 5


def patiently(share: Callable[[], T]) -> T:
    """`share()`, asked again while torch's shared-memory manager is too slow to answer.

    torch's libshm gives `torch_shm_manager` one second to answer each allocation (its socket's
    `poll(..., 1000)`); on a host whose cores are all busy the daemon can miss that, and the
    allocation raises before the storage is touched. So it is asked again, up to 5 times in all;
    any other error, and the fifth timeout, are raised as they are.
    """
    for _ in range(_MANAGER_ATTEMPTS - 1):
        try:
            return share()
        except RuntimeError as exc:
            if _MANAGER_TIMEOUT not in str(exc):
                raise
    return share()


_shm_manager_lock = threading.Lock()
_shm_manager_started = False


def _start_shm_manager_quietly() -> None:
    """Start torch's `torch_shm_manager` with stderr on /dev/null, once per process.

    The first CPU storage shared by file name starts that daemon, which inherits stderr and lives
    as long as any process maps a shared file: a server's, possibly longer than this process. It
    would hold the caller's stderr pipe open (`colocate run 2>&1 | tee log` would never end).
    Redirecting fd 2 is process-wide, so it happens once, under a lock held for that one start.
    """
    global _shm_manager_started
    with _shm_manager_lock:
        if _shm_manager_started:
            return
        saved = os.dup(2)
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        try:
            torch.empty(1).untyped_storage()._share_filename_cpu_()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        _shm_manager_started = True


def serialize(obj: object) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`: `_Pickler`, then
    standard base64. Reads and changes no process-global setting, so threads may call it at once."""
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flattened_bucket(named: Sequence[Named]) -> dict[str, Any]:
    """The dict SGLang's `_update_weights_from_flattened_bucket` reads.

    `flattened_tensor`: every tensor's bytes, concatenated (uint8, one device). `metadata`: per
    tensor `name, shape, dtype, start_idx, end_idx, numel` (byte offsets), the fields of SGLang's
    `FlattenedTensorMetadata`. Entries are `types.SimpleNamespace`: SGLang reads them by attribute
    and its SafeUnpickler allows that type; pickling SGLang's own class would need sglang here.

    SGLang rebuilds each tensor as a `view(dtype)` of its byte range, which torch refuses unless
    the offset is a multiple of the dtype's size (an odd-length bf16 tensor before an fp32 one).
    So the widest dtypes go first: every offset is then aligned, with no padding.
    """
    if not named:
        raise ValueError("cannot send an empty bucket")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        raise ValueError(f"one bucket, one device: got {sorted(map(str, devices))}")
    chunks, metadata, offset = [], [], 0
    for name, tensor in sorted(named, key=lambda pair: -pair[1].element_size()):  # stable: same-width order kept
        chunk = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + chunk.numel(),
                numel=chunk.numel(),
            )
        )
        chunks.append(chunk)
        offset += chunk.numel()
    return {"flattened_tensor": torch.cat(chunks), "metadata": metadata}
