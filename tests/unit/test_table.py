"""Every (phase, event) pair is legal or refused exactly as states.TABLE says."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from orchestrator import ActionFailed, GuardRejected, IllegalTransition
from orchestrator.errors import FaultWithoutCause
from states import TABLE, Event, Phase
from tests.support.rig import Rig, make_rig

ROWS = {(row.source, row.event): row for row in TABLE}


def _reach(phase: Phase) -> Rig:
    """Drive a fresh rig into `phase` the way a run would."""
    rig = make_rig()
    lc = rig.lifecycle
    path: dict[Phase, list[Callable[[], object]]] = {
        Phase.TRAIN: [],
        Phase.GRADS_PAUSED: [lc.pause_grads],
        Phase.WEIGHTS_SYNCED: [lc.pause_grads, lc.update_weights],
        Phase.PARAMS_DROPPED: [lc.pause_grads, lc.update_weights, lc.drop_params],
        Phase.ROLLOUT: [lc.pause_grads, lc.update_weights, lc.drop_params, lc.rollout],
        Phase.FAULTED: [lambda: lc.fault("test")],
    }
    for fire in path[phase]:
        fire()
    assert lc.phase is phase
    return rig


# On the natural path into each phase, these legal events are refused by a guard.
GUARDED_THERE = {
    (Phase.GRADS_PAUSED, Event.SKIP_UPDATE),  # the engine was never synced
    (Phase.TRAIN, Event.SAVE),  # no sync yet: the engine's weight version is not known
}


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("event", list(Event))
def test_every_pair_is_legal_or_refused_as_the_table_says(phase: Phase, event: Event) -> None:
    rig = _reach(phase)
    lc = rig.lifecycle
    calls_before = (list(rig.regions.calls), list(rig.engine.calls))
    row = ROWS.get((phase, event))
    if row is None:
        with pytest.raises(IllegalTransition) as info:
            lc.fire(event)
        assert (info.value.state, info.value.event) == (phase, event)
        assert lc.phase is phase
        assert (rig.regions.calls, rig.engine.calls) == calls_before, "a refused event must not touch adapters"
    elif event is Event.FAULT:
        with pytest.raises(FaultWithoutCause):
            lc.fire(event)  # a fault needs a cause
        assert lc.phase is phase
        lc.fault("rank 1 died")
        assert lc.phase is row.dest
    elif (phase, event) in GUARDED_THERE:
        with pytest.raises(GuardRejected):
            lc.fire(event)
        assert lc.phase is phase
    else:
        lc.fire(event)
        assert lc.phase is row.dest


def test_only_recover_leaves_faulted() -> None:
    legal = [e for e in Event if (Phase.FAULTED, e) in ROWS]
    assert legal == [Event.RECOVER]


def test_the_cycle_visits_the_five_phases_in_order() -> None:
    rig = make_rig()
    lc, seen = rig.lifecycle, []
    for fire in (lc.pause_grads, lc.update_weights, lc.drop_params, lc.rollout, lc.restore):
        fire()
        seen.append(lc.phase)
    assert seen == [Phase.GRADS_PAUSED, Phase.WEIGHTS_SYNCED, Phase.PARAMS_DROPPED, Phase.ROLLOUT, Phase.TRAIN]


def test_action_failure_faults_and_keeps_cause() -> None:
    rig = make_rig()
    rig.transport.fail = True
    rig.lifecycle.pause_grads()
    with pytest.raises(ActionFailed) as info:
        rig.lifecycle.update_weights()
    assert rig.lifecycle.phase is Phase.FAULTED
    assert isinstance(info.value.cause, RuntimeError)
    assert "success=false" in str(info.value)
    assert rig.lifecycle.fault_cause is info.value.cause
