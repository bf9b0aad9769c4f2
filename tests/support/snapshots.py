"""A healthy snapshot for guard tests, changed one field at a time."""

from __future__ import annotations

from dataclasses import replace

from states import Mode, Phase, Region, Snapshot, Source, TrainerLayout

LAYOUT = TrainerLayout(sync_sources={"w": Source.PARAM_BUFFER, "router.expert_bias": Source.EXTRAS})


def snap(**changes: object) -> Snapshot:
    """A healthy snapshot in GRADS_PAUSED after a trained step; tests change one thing."""
    base = Snapshot(
        phase=Phase.GRADS_PAUSED,
        mode=Mode.REMATERIALIZE,
        step=3,
        paused=frozenset({Region.GRAD_BUFFER, Region.DEFAULT}),
        engine_attached=True,
        engine_resident=frozenset(),
        engine_idle=True,
        engine_synced=True,
        engine_version=2,
        weight_version=2,
        cache_flushed=True,
        trained_since_sync=True,
        extras_stashed=True,
        params_valid=False,
        layout=LAYOUT,
    )
    return replace(base, **changes)  # type: ignore[arg-type]
