"""colocate's controller: the lifecycle, its adapters' Protocols, tracing, logging and the CLI."""

import importlib
from typing import TYPE_CHECKING, Any

from orchestrator.core.config import Checkpoint, LifecycleConfig, Verify
from orchestrator.core.lifecycle import Lifecycle
from orchestrator.errors import (
    ActionFailed,
    ConfigError,
    EngineError,
    EventInFlight,
    FaultWithoutCause,
    GuardRejected,
    IllegalTransition,
    LifecycleError,
    RankFailed,
    RecoveryRefused,
    RegionRefused,
    RestoreMismatch,
    StashMismatch,
)
from orchestrator.protocols import (
    EngineDefaults,
    EngineFeatures,
    MemoryRegions,
    RolloutEngine,
    Trainer,
    TrainerControl,
    TransferReport,
    WeightTransport,
)
from orchestrator.telemetry.listeners import FanOut, Listener, TransitionRecord

if TYPE_CHECKING:
    from orchestrator.adapters.megatron.cpu import enable_cpu_path
    from orchestrator.adapters.megatron.embed import colocate_megatron
    from orchestrator.adapters.megatron.options import Memory, Sync

# Names whose modules import torch: loaded at first use, so `import orchestrator` (and
# `colocate diagram`) needs neither torch nor megatron-core.
_LAZY = {
    "colocate_megatron": "orchestrator.adapters.megatron.embed",
    "enable_cpu_path": "orchestrator.adapters.megatron.cpu",
    "Memory": "orchestrator.adapters.megatron.options",  # colocate_megatron's option groups
    "Sync": "orchestrator.adapters.megatron.options",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")


__all__ = [
    "ActionFailed",
    "Checkpoint",
    "ConfigError",
    "EngineDefaults",
    "EngineError",
    "EngineFeatures",
    "EventInFlight",
    "FanOut",
    "FaultWithoutCause",
    "GuardRejected",
    "IllegalTransition",
    "Lifecycle",
    "LifecycleConfig",
    "LifecycleError",
    "Listener",
    "Memory",
    "MemoryRegions",
    "RankFailed",
    "RecoveryRefused",
    "RegionRefused",
    "RestoreMismatch",
    "RolloutEngine",
    "StashMismatch",
    "Sync",
    "Trainer",
    "TrainerControl",
    "TransferReport",
    "TransitionRecord",
    "Verify",
    "WeightTransport",
    "colocate_megatron",
    "enable_cpu_path",
]
