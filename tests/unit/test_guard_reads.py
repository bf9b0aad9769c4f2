"""`guards.READS` is what each guard really reads: a guard judging a snapshot whose other
components were not asked gives the verdict it gives with all of them, and one that reads a field
it does not declare raises rather than judging a placeholder."""

from __future__ import annotations

import dataclasses

import pytest

from guards import GUARDS, READS, trainer
from orchestrator.core.state import Unasked
from states import Snapshot
from tests.support.rig import make_rig

FIELDS = {
    "regions": ("paused",),
    "trainer": ("params_valid",),
    "engine": ("engine_resident", "engine_idle", "engine_version"),
    "memory": ("memory",),
}


def unasked_beyond(snap: Snapshot, reads: frozenset[str]) -> Snapshot:
    fields = {f: Unasked(f) for component, names in FIELDS.items() if component not in reads for f in names}
    return dataclasses.replace(snap, **fields)


def snapshots() -> list[Snapshot]:
    """Every phase of a cycle, twice over, and a step that trained in between."""
    rig = make_rig()
    lc, seen = rig.lifecycle, []
    for _ in range(2):
        seen.append(lc.snapshot())
        for event in ("pause_grads", "update_weights", "drop_params", "rollout", "restore"):
            getattr(lc, event)()
            seen.append(lc.snapshot())
        lc.train(rig.trainer.optimizer_step)
    return seen


def test_every_guard_reads_only_what_it_declares() -> None:
    assert READS.keys() == GUARDS.keys()
    for snap in snapshots():
        for name, check in GUARDS.items():
            assert check(unasked_beyond(snap, READS[name])) == check(snap), (name, snap.phase)


def test_a_guard_that_reads_an_unasked_field_raises() -> None:
    snap = unasked_beyond(snapshots()[0], frozenset())
    with pytest.raises(AssertionError, match=r"guards\.READS does not list"):
        trainer.trainer_resident(snap)
