"""Trainer-side guards: what must be resident, and what the weight sync may read."""

from __future__ import annotations

from guards.verdict import guard, names
from states import Region, Snapshot, Source


@guard
def trainer_resident(snap: Snapshot) -> str | None:
    if snap.paused:
        return f"trainer regions are paused ({names(snap.paused)}): params, grads and optimizer must be resident"
    return None


@guard
def params_valid(snap: Snapshot) -> str | None:
    """A checkpoint holds the params as they are: they must be cast(mains), not dropped or stale."""
    if not snap.params_valid:
        return "the params are not cast(mains) now (dropped, or a step began since they were rebuilt or verified)"
    return None


@guard
def sync_source_resident(snap: Snapshot) -> str | None:
    """Every tensor handed to the sync is in a resident param buffer or in the extras backup."""
    sources = snap.layout.sync_sources
    elsewhere = [n for n, s in sources.items() if s is Source.ELSEWHERE]
    if elsewhere:
        return f"sync source has tensors in neither a param buffer nor the extras backup: {names(elsewhere)}"
    if not snap.param_buffer_resident and Source.PARAM_BUFFER in sources.values():
        return "the param buffer is paused: a sync would read dropped memory"
    if not snap.extras_stashed and Source.EXTRAS in sources.values():
        return "the extras backup is not current: pause_grads stashes it before the optimizer state is paused"
    return None


@guard
def restore_coverage(snap: Snapshot) -> str | None:
    uncovered = snap.layout.uncovered
    if uncovered:
        return (
            f"{len(uncovered)} tensor(s) are neither rebuilt from the fp32 mains nor extras, so a drop would lose them: "
            f"{names(uncovered)}"
        )
    return None


@guard
def params_dropped(snap: Snapshot) -> str | None:
    """The engine's KV cache comes back only once the trainer's bf16 params are gone."""
    if Region.PARAM_BUFFER not in snap.paused:
        return "the trainer's param buffer is still resident: resuming the KV cache now risks an OOM"
    return None
