"""colocate's controller: the lifecycle, its adapters' Protocols, tracing, logging and the CLI."""

from orchestrator.config import LifecycleConfig
from orchestrator.errors import (
    ActionFailed,
    ConfigError,
    EngineError,
    GuardRejected,
    IllegalTransition,
    LifecycleError,
    RegionRefused,
    RestoreMismatch,
)
from orchestrator.lifecycle import Lifecycle
from orchestrator.listeners import FanOut, Listener, TransitionRecord
from orchestrator.protocols import MemoryRegions, RolloutEngine, Trainer, TransferReport, WeightTransport

__all__ = [
    "ActionFailed",
    "ConfigError",
    "EngineError",
    "FanOut",
    "GuardRejected",
    "IllegalTransition",
    "Lifecycle",
    "LifecycleConfig",
    "LifecycleError",
    "Listener",
    "MemoryRegions",
    "RegionRefused",
    "RestoreMismatch",
    "RolloutEngine",
    "Trainer",
    "TransferReport",
    "TransitionRecord",
    "WeightTransport",
]
