"""Where each checkpoint tensor of a transformers model lives: a view of one of its live tensors.

transformers 5 fuses some checkpoint tensors into one param when `from_pretrained` loads them (an
MoE layer's `experts.<e>.gate_proj.weight`, `up_proj` and `down_proj` become rows of the 3-D
`experts.gate_up_proj` and `experts.down_proj`) and renames others (Mixtral's
`block_sparse_moe.` becomes `mlp.`). An engine that loads a weight sync bucket by bucket must
write each checkpoint tensor where `from_pretrained` would, without waiting for the rest of its
fused param, as SGLang's loaders do.

`checkpoint_views(model)` reads where from transformers' own mapping, not from a table of ours.
It runs the mapping's reverse (what `save_pretrained` writes) over tensors of element indices,
one per live tensor, so each checkpoint name comes out holding the indices of the elements it
fills. Stacks, chunks and transposes keep those indices evenly strided, so each is one strided
view of one live tensor; a mapping that scatters them otherwise is refused by name.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

import torch
from transformers import PreTrainedModel

__all__ = ["CheckpointSlots", "checkpoint_views", "live_tensors", "same_tensor"]


def live_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What a checkpoint of `model` holds: its params and persistent buffers (an MoE router's
    `e_score_correction_bias`), each tensor once under its first name (a tied `lm_head.weight`
    is the embedding's)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor
    return tensors


def _strides(index: torch.Tensor) -> tuple[int, ...]:
    """The stride of each dim in an index tensor that is an evenly strided view of its source."""
    first = index.reshape(-1)[0]
    strides = []
    for dim, size in enumerate(index.shape):
        step = index.narrow(dim, 1, 1).reshape(-1)[0] - first if size > 1 else torch.tensor(1)
        strides.append(int(step))
    return tuple(strides)


def _view(name: str, index: torch.Tensor, starts: list[int], owners: list[torch.Tensor]) -> torch.Tensor:
    """The view of the live tensor whose elements `index` (global element indices) names."""
    position = bisect_right(starts, int(index.min())) - 1
    owner, local = owners[position], index - starts[position]
    strides, offset = _strides(local), int(local.reshape(-1)[0])
    elements = torch.arange(owner.numel()).view(owner.shape)
    if int(local.max()) >= owner.numel() or not torch.equal(elements.as_strided(index.shape, strides, offset), local):
        raise ValueError(f"checkpoint tensor {name!r} is no strided view of one model tensor: it cannot load in place")
    return owner.detach().as_strided(index.shape, strides, owner.storage_offset() + offset)


def checkpoint_views(model: PreTrainedModel, tensors: Iterable[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each checkpoint name `from_pretrained` loads for `model` → the view of the live tensor it
    fills (see the module docstring). `tensors` are the model's live tensors in `live_tensors`
    order (default: read now); each must be contiguous. A tied tensor's names all map to it.

    Raises ValueError naming a checkpoint tensor that is no strided view of one live tensor."""
    from transformers.core_model_loading import revert_weight_conversion

    named = live_tensors(model)
    owners = list(named.values()) if tensors is None else list(tensors)
    starts, indices, total = [], {}, 0
    for (name, _), owner in zip(named.items(), owners, strict=True):
        starts.append(total)
        indices[name] = torch.arange(total, total + owner.numel()).view(owner.shape)
        total += owner.numel()
    for alias, tensor in model.state_dict(keep_vars=True).items():  # tied names: the same indices
        if alias not in indices:
            first = next(n for n, t in named.items() if t is tensor)
            indices[alias] = indices[first]
    reverted = revert_weight_conversion(model, indices)
    return {name: _view(name, index, starts, owners) for name, index in reverted.items()}


def same_tensor(views: dict[str, torch.Tensor], prefer: Iterable[str] = ()) -> dict[str, str]:
    """Each name → the one name of all those whose views are the same elements (a tied embedding
    and `lm_head`), the first of `prefer` where one is, else the first in `views`."""
    preferred = set(prefer)
    first: dict[tuple[int, torch.Size, tuple[int, ...]], str] = {}
    for name in sorted(views, key=lambda n: n not in preferred):  # stable: `prefer`'s names first
        view = views[name]
        first.setdefault((view.data_ptr(), view.shape, view.stride()), name)
    return {name: first[(v.data_ptr(), v.shape, v.stride())] for name, v in views.items()}


class CheckpointSlots:
    """A model's checkpoint names and where each loads: `views` (`checkpoint_views`); `slot`, each
    name's slot (`same_tensor`: tied names share one, under the model's own first name); `names`,
    one per slot."""

    def __init__(self, model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> None:
        self.views = checkpoint_views(model, tensors.values())
        self.slot = same_tensor(self.views, prefer=tensors)
        self.names = tuple(dict.fromkeys(self.slot.values()))
