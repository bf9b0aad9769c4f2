"""colocate's controller: the lifecycle, its adapters' Protocols, tracing, logging and the CLI."""

from orchestrator.core.config import LifecycleConfig
from orchestrator.core.lifecycle import Lifecycle
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
from orchestrator.protocols import MemoryRegions, RolloutEngine, Trainer, TransferReport, WeightTransport
from orchestrator.telemetry.listeners import FanOut, Listener, TransitionRecord

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
