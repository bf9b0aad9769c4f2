"""`Known`: what one rank's controller has done to memory and weights, as it did it.

The actions write it (core/actions.py); the lifecycle reads it into the `Snapshot` its guards
judge, beside what it asks the adapters (whether the engine is idle, which version it serves) and
the regions its `RegionLedger` holds paused. None of it is re-derived from the adapters: it is the
controller's own account, which `recover` reconciles with what is actually resident.
"""

from __future__ import annotations

from dataclasses import dataclass

from states import EngineMemory


@dataclass(slots=True)
class Known:
    """What the controller knows because it did it (never re-derived from the adapters)."""

    step: int = 0
    # The engine: which of its memory colocate resumed and has not released since; whether it
    # serves the weights of the last sync, which version that was, and whether its cache was
    # flushed after the sync's last bucket.
    engine_resident: frozenset[EngineMemory] = frozenset()
    engine_synced: bool = False
    weight_version: int = 0
    cache_flushed: bool = True
    # The trainer: an optimizer step since the last sync; the extras (expert_bias, fp32 and
    # frozen params) copied aside before `default` is paused.
    trained_since_sync: bool = False
    extras_stashed: bool = False
    # Rematerialization: whether the bf16 params are the ones the fp32 mains (or backup) define,
    # and the checks of the first `verify_cycles` drop/restore cycles.
    params_valid: bool = True
    cycles: int = 0  # completed drop/restore cycles
    digests: dict[str, str] | None = None  # taken at the drop of a verified cycle, kept until verified
    last_restore_verified: bool | None = None
