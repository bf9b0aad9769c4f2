"""What a sync allocates, seen from inside torch's dispatcher, and how many gathers it owes (for the
conversion tests' ranks)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncWatch", "sharded_tensors"]


class SyncWatch(TorchDispatchMode):
    """While on: the bytes of the tensors made and still alive (every op's new storage counts from
    the op until it is freed, on whichever thread drops it), `peak` the most at once, and
    `gathers` the all-gathers. Storages an op shares with its inputs (views, in-place ops,
    `detach`) are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.held = self.peak = self.gathers = 0
        self._live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.held -= self._live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.gathers += str(func).startswith("c10d.allgather")
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._live or not storage.nbytes():
                continue
            self._live[key] = storage.nbytes()
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
            weakref.finalize(storage, self._free, key)
        return out


def sharded_tensors(chunks: list[Any]) -> int:
    """How many of this rank's tensors other ranks hold parts of (plus the one exchange of expert
    ranks an MoE model's sync starts with)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    experts = ps.get_expert_tensor_parallel_world_size() * ps.get_expert_model_parallel_world_size()
    count = int(bool(chunks[0].config.num_moe_experts))
    first_stage = ps.is_pipeline_first_stage()
    for name, param in chunks[0].named_parameters():
        if ".mtp." in name or (".embedding." in name and not first_stage):
            continue  # left out: the MTP layers, and their stage's copy of the embedding
        if ".local_experts." in name:
            count += experts > 1
        else:
            count += tp > 1 and bool(getattr(param, "tensor_model_parallel", False))
    return count
