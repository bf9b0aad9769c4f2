"""colocate's controller: the lifecycle, its adapters' Protocols, tracing, logging and the CLI."""

from orchestrator.config import LifecycleConfig
from orchestrator.errors import (
    ActionFailed,
    ConfigError,
    EngineError,
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
from orchestrator.lifecycle import Lifecycle
from orchestrator.listeners import FanOut, Listener, TransitionRecord
from orchestrator.protocols import MemoryRegions, RolloutEngine, Trainer, TransferReport, WeightTransport

__all__ = [
    "ActionFailed",
    "ConfigError",
    "EngineError",
    "FanOut",
    "FaultWithoutCause",
    "GuardRejected",
    "IllegalTransition",
    "Lifecycle",
    "LifecycleConfig",
    "LifecycleError",
    "Listener",
    "MemoryRegions",
    "RankFailed",
    "RecoveryRefused",
    "RegionRefused",
    "RestoreMismatch",
    "RolloutEngine",
    "StashMismatch",
    "Trainer",
    "TransferReport",
    "TransitionRecord",
    "WeightTransport",
]
