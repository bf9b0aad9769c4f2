"""The option groups of `colocate_megatron` that only the embedding has: how weights reach the
engine (`Sync`) and what memory the rollout frees (`Memory`). The groups it shares with
`colocate run` (`Verify`, `Checkpoint`) are in `orchestrator.core.config`.

The flat keywords these groups replace still work for one release: each is moved into its group
with a DeprecationWarning naming the group (`grouped`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.core.config import Checkpoint, Verify
from orchestrator.protocols import MemoryRegions, WeightTransport
from states import MemoryBudget, Offload

if TYPE_CHECKING:
    from orchestrator.adapters.megatron.transport import Converter


@dataclass(frozen=True, kw_only=True, slots=True)
class Sync:
    """How the trained weights reach the engine.

    `transport`: the whole path, replacing what follows. `convert`: the conversion the default
    `MegatronTransport` sends through (default: `hf_buckets`, the family read from the config).
    `bucket_bytes`: the most bytes one `update_weights` call carries. `served_config`: the HF
    config the engine loaded (a `config.json`, its folder, or its dict), checked against the
    model. `mtp`: the MTP layers too, for an engine serving them as its NextN draft."""

    transport: WeightTransport | None = None
    convert: Converter | None = None
    bucket_bytes: int = 64 << 20
    served_config: str | Path | Mapping[str, Any] | None = None
    mtp: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    """What leaves the device for the rollout, and through which regions.

    `offload`: which of `grad_buffer` and `default` leave (`orchestrator.core.offload`); `auto`
    decides from `budget`, the memory guard's input (`orchestrator.plan.MemoryProbe.for_plan`),
    and moves both without one. `regions`: the memory regions (default: torch_memory_saver where
    the param buffers are on a GPU, storage resizing on the CPU)."""

    offload: Offload | str = Offload.AUTO
    budget: Callable[[], MemoryBudget] | None = None
    regions: MemoryRegions | None = None


# Each flat keyword of the release before, and its place: (group keyword, field of the group).
_MOVED: dict[str, tuple[str, str]] = {
    "transport": ("sync", "transport"),
    "convert": ("sync", "convert"),
    "bucket_bytes": ("sync", "bucket_bytes"),
    "served_config": ("sync", "served_config"),
    "mtp": ("sync", "mtp"),
    "offload": ("memory", "offload"),
    "regions": ("memory", "regions"),
    "digest": ("verify", "digest"),
    "verify_cycles": ("verify", "cycles"),
    "save_dir": ("checkpoint", "save_dir"),
    "save_every": ("checkpoint", "save_every"),
    "resume": ("checkpoint", "resume"),
    "checkpoint_state": ("checkpoint", "state"),
}
_GROUP_TYPES: dict[str, type] = {"sync": Sync, "memory": Memory, "verify": Verify, "checkpoint": Checkpoint}


@dataclass(frozen=True, kw_only=True, slots=True)
class Groups:
    """`colocate_megatron`'s option groups, once the deprecated flat keywords are moved in."""

    sync: Sync
    memory: Memory
    verify: Verify
    checkpoint: Checkpoint


def grouped(groups: Groups, flags: Mapping[str, Any], *, memory: Any, stacklevel: int) -> tuple[Groups, dict[str, Any]]:
    """The groups with each deprecated flat keyword of `flags` moved into its own (warning once
    for each, naming the group), and the flags left: the trainer's `TrainingSetup` flags.

    `memory`: what was passed as `memory=`: None, the group, or (deprecated) the budget it used to
    be. A flat keyword overrides that field of a group passed beside it."""
    changes: dict[str, dict[str, Any]] = {}
    if memory is not None and not isinstance(memory, Memory):  # the memory guard's budget, as `memory=` took it before
        _warn("memory", "memory", "budget", stacklevel)
        changes.setdefault("memory", {})["budget"] = memory
    for name in [name for name in flags if name in _MOVED]:
        group, field = _MOVED[name]
        _warn(name, group, field, stacklevel)
        changes.setdefault(group, {})[field] = flags[name]
    moved = {group: dataclasses.replace(getattr(groups, group), **fields) for group, fields in changes.items()}
    return dataclasses.replace(groups, **moved), {k: v for k, v in flags.items() if k not in _MOVED}


def _warn(name: str, group: str, field: str, stacklevel: int) -> None:
    kind = _GROUP_TYPES[group].__name__
    warnings.warn(
        f"{name}= is deprecated: pass {group}={kind}({field}=...)", DeprecationWarning, stacklevel=stacklevel + 2
    )
