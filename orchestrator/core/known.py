"""`Known`: what one rank's controller did and cannot ask an adapter for.

The actions write it (core/actions.py); the lifecycle reads it into the `Snapshot` its guards
judge. What an adapter can say is never kept here: which regions are paused (`MemoryRegions.paused`),
which engine memory is released (`RolloutEngine.released`), which version it serves and whether it
is idle are asked each time, so a call that failed after it took effect leaves no stale belief.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Known:
    """What the controller knows because it did it."""

    step: int = 0
    # The engine: whether it serves the weights of the last sync, which version that was, and
    # whether its cache was flushed after the sync's last bucket.
    engine_synced: bool = False
    weight_version: int = 0
    cache_flushed: bool = True
    # The trainer: whether the actor's optimizer began a step since the last sync (its
    # `mains_generation` moved from `synced_generation`; a critic's work under `train` does not
    # move it); the extras (expert_bias, fp32 and frozen params) copied aside before `default` is paused.
    trained_since_sync: bool = False
    synced_generation: int | None = None
    extras_stashed: bool = False
    # The trainer's `mains_generation` when the params were last seen equal to cast(mains): after
    # a train event's work returned, after a rebuild that needs no check. None while they are
    # dropped or unchecked. A generation that moved since means a step began after: rebuild.
    params_generation: int | None = None
    cycles: int = 0  # completed drop/restore cycles
    digests: dict[str, str] | None = None  # taken at the drop of a verified cycle, kept until verified
    last_restore_verified: bool | None = None
