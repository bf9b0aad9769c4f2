"""The critic-only fence: sync only weights that changed, skip only a sync that is redundant."""

from __future__ import annotations

from guards.verdict import guard
from states import Snapshot


@guard
def weights_changed(snap: Snapshot) -> str | None:
    if snap.engine_synced and not snap.trained_since_sync:
        return (
            f"no optimizer step since version {snap.weight_version} (a critic-only step?): "
            "the update is redundant; fire skip_update"
        )
    return None


@guard
def weights_unchanged(snap: Snapshot) -> str | None:
    if snap.trained_since_sync:
        return "the actor trained since the last sync: its weights must be pushed, not skipped"
    return None
