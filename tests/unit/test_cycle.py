"""`states.CYCLE`: one colocated step, read off the transition table once, in order."""

from __future__ import annotations

import itertools

import pytest

from states import CYCLE, INITIAL, TABLE, Event, Phase, Transition
from states.table import _cycle
from tests.support.cli import CYCLE as STEP_PHASES  # a full step's phases, written out by hand


def test_the_cycle_is_the_step_the_readme_draws() -> None:
    # train → pause-grads → update_weights → drop-params → rollout → restore → train
    assert [row.event for row in CYCLE] == [
        Event.TRAIN, Event.PAUSE_GRADS, Event.UPDATE_WEIGHTS, Event.DROP_PARAMS, Event.ROLLOUT, Event.RESTORE
    ]  # fmt: skip
    assert [INITIAL, *(row.dest for row in CYCLE[1:])] == STEP_PHASES


def test_the_cycle_is_rows_of_the_table_that_chain_back_to_the_start() -> None:
    assert all(row in TABLE for row in CYCLE)
    assert CYCLE[0].source is CYCLE[0].dest is INITIAL  # the step's own work
    assert all(a.dest is b.source for a, b in itertools.pairwise(CYCLE))
    assert CYCLE[-1].dest is INITIAL


def test_fault_rows_listed_first_are_still_no_part_of_the_cycle() -> None:
    faults = tuple(row for row in TABLE if row.dest is Phase.FAULTED)
    assert _cycle(faults + TABLE, INITIAL) == CYCLE


def test_a_table_with_no_way_back_has_no_cycle() -> None:
    no_restore = tuple(row for row in TABLE if row.event is not Event.RESTORE)
    with pytest.raises(ValueError, match="no row leaving ROLLOUT"):
        _cycle(no_restore, INITIAL)


def test_a_table_whose_cycle_loops_elsewhere_is_refused() -> None:
    P, E = Phase, Event
    loop = (
        Transition(P.TRAIN, E.TRAIN, P.TRAIN),
        Transition(P.TRAIN, E.PAUSE_GRADS, P.GRADS_PAUSED),
        Transition(P.GRADS_PAUSED, E.UPDATE_WEIGHTS, P.WEIGHTS_SYNCED),
        Transition(P.WEIGHTS_SYNCED, E.DROP_PARAMS, P.GRADS_PAUSED),
    )
    with pytest.raises(ValueError, match="never returns to TRAIN"):
        _cycle(loop, INITIAL)


def test_a_table_with_no_work_in_the_first_phase_has_no_cycle() -> None:
    with pytest.raises(ValueError, match="no row staying in TRAIN"):
        _cycle(tuple(row for row in TABLE if row.source is not row.dest), INITIAL)
