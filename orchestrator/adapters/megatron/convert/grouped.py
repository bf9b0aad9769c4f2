"""Megatron's GroupedMLP, read as the per-expert tensors of a SequentialMLP, which the rules map.

With `moe_grouped_gemm=True` and the local (non-Transformer-Engine) spec, megatron-core 0.16.1
builds a layer's experts as `GroupedMLP`: two params for all of its local experts,
`mlp.experts.weight1` [hidden, experts · 2 · ffn] and `weight2` [experts · ffn, hidden] (ffn per
expert-tensor-parallel rank). Its forward reinterprets their memory, not their matrices:
`weight1.view(experts, hidden, -1)[e]` is expert e's fc1 as `x @ w` (columns [gate | up]) and
`weight2.view(experts, -1, hidden)[e]` its fc2. Expert e's SequentialMLP `linear_fc1.weight`
([gate; up] rows) is therefore the transpose of the first block and `linear_fc2.weight` that of
the second: the layout `GroupedMLP.sharded_state_dict` writes to Megatron's own checkpoints, in
which the two modules are interchangeable.

An expert-tensor-parallel rank's blocks are its shards of those tensors in the same way (its
ffn slice of [gate | up], and of fc2's input): SequentialMLP's column-parallel fc1 (partition
dim 0) and row-parallel fc2 (partition dim 1).

Transformer Engine's `TEGroupedMLP` (`linear_fc1.weight0`, ...) is another layout; it is refused
by name, since it cannot be built here to check a conversion against.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

__all__ = ["GROUPED", "TE_GROUPED", "per_expert", "per_expert_names", "read_as"]

GROUPED = re.compile(r"^(?P<experts>decoder\.layers\.\d+\.mlp\.experts\.)weight(?P<fc>[12])$")
TE_GROUPED = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")

# SequentialMLP's linear, and the dim its expert-tensor-parallel shards split.
_FC = {"1": ("linear_fc1", 0), "2": ("linear_fc2", 1)}


def per_expert_names(name: str, experts: int) -> list[str] | None:
    """The SequentialMLP names of GroupedMLP param `name`'s `experts` experts; None when `name`
    is no GroupedMLP weight."""
    match = GROUPED.match(name)
    if match is None:
        return None
    fc, _ = _FC[match["fc"]]
    return [f"{match['experts']}local_experts.{e}.{fc}.weight" for e in range(experts)]


def per_expert(name: str, tensor: torch.Tensor, experts: int, hidden: int) -> list[tuple[str, torch.Tensor, int]]:
    """GroupedMLP param `name` as `experts` SequentialMLP tensors: (name, view of `tensor` in
    SequentialMLP's layout, the dim its expert-tensor-parallel shards split).

    Raises ValueError when `tensor` is not `experts` blocks of a GroupedMLP weight of `hidden`."""
    names = per_expert_names(name, experts)
    if names is None:
        raise ValueError(f"{name!r} is not a GroupedMLP weight")
    fc, dim = _FC[GROUPED.match(name)["fc"]]  # type: ignore[index]
    hidden_dim = 0 if fc == "linear_fc1" else 1
    if tensor.dim() != 2 or tensor.shape[hidden_dim] != hidden or tensor.shape[1 - hidden_dim] % experts:
        raise ValueError(
            f"cannot convert {name!r}: shape {tuple(tensor.shape)} is not {experts} experts' GroupedMLP "
            f"{fc} of hidden size {hidden}"
        )
    blocks = tensor.view(experts, hidden, -1) if fc == "linear_fc1" else tensor.view(experts, -1, hidden)
    return [(expert, block.t(), dim) for expert, block in zip(names, blocks, strict=True)]


@contextlib.contextmanager
def read_as(name: str) -> Iterator[None]:
    """Errors about the SequentialMLP tensors GroupedMLP weight `name` is read as name it too."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{name!r}, read per expert: {error}") from None
