"""Rollout-engine guards: attached, idle, synced, flushed, versions moving forward."""

from __future__ import annotations

from guards.verdict import guard
from states import EngineMemory, Mode, Snapshot


@guard
def engine_attached(snap: Snapshot) -> str | None:
    if snap.mode is Mode.TRAIN_ONLY:
        return "a train-only run never updates weights: it has no engine to sync"
    if not snap.engine_attached:
        return "no rollout engine is attached"
    return None


@guard
def engine_idle(snap: Snapshot) -> str | None:
    if not snap.engine_idle:
        return "the engine still has requests in flight: release would fail or lose them"
    return None


@guard
def engine_synced(snap: Snapshot) -> str | None:
    """No generate before the engine serves exactly the weights colocate last pushed."""
    if not snap.engine_synced:
        return "the engine has not received its first weight sync: it would serve random or stale weights"
    if snap.engine_version != snap.weight_version:
        return f"the engine serves version {snap.engine_version}, colocate pushed {snap.weight_version}"
    return None


@guard
def engine_version_known(snap: Snapshot) -> str | None:
    """A checkpoint names the weight version the engine serves; a resume pushes the one after it."""
    if not snap.engine_attached:
        return None  # train-only: no engine, no version to name
    if not snap.engine_synced:
        return "the engine has had no sync since it started or recovered: its weight version is not known"
    if snap.engine_version != snap.weight_version:
        return f"the engine serves version {snap.engine_version}, colocate pushed {snap.weight_version}"
    return None


@guard
def cache_flushed(snap: Snapshot) -> str | None:
    if not snap.cache_flushed:
        return "the engine cache was not flushed after the last update: it would serve stale KV / prefixes"
    return None


@guard
def version_increasing(snap: Snapshot) -> str | None:
    if snap.engine_version is not None and snap.engine_version >= snap.weight_version + 1:
        return (
            f"the next version {snap.weight_version + 1} does not exceed the engine's {snap.engine_version}: "
            "rollouts would be attributed to the wrong policy"
        )
    return None


@guard
def engine_kv_released(snap: Snapshot) -> str | None:
    """Trainer params and engine weights may coexist for the update, never with the KV cache."""
    resident = snap.engine_resident & {EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH}
    if resident:
        return f"engine {', '.join(sorted(resident))} resident while the trainer params are: OOM risk"
    return None


@guard
def engine_weights_resident(snap: Snapshot) -> str | None:
    if EngineMemory.WEIGHTS not in snap.engine_resident:
        return "the engine's weight memory is released: an update would write into unmapped memory"
    return None
