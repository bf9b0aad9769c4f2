"""Faults from other threads (issue 24, F and G): one writer of the phase.

A `fault()` from a watchdog thread while an event's action runs is held, and it wins: the event
lands in FAULTED, never in its destination, and its caller gets ActionFailed carrying that fault.
A fault during recover fails that recover, and the first cause stays until a recover resolves it.
Each test uses real threads and runs many times over, with the fault landing at varied moments.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from orchestrator import ActionFailed, EventInFlight, IllegalTransition, Listener, TransitionRecord
from states import Event, Phase
from tests.support.rig import Rig, cycle, make_rig

ROUNDS = 200


class Watchdog(RuntimeError):
    """A rank died, as another thread saw it."""


def fault_from_another_thread(rig: Rig, started: threading.Event, done: threading.Event) -> threading.Thread:
    """Wait for the action to start, then (after a random moment) fault from another thread."""

    def watch() -> None:
        started.wait(5)
        if random.random() < 0.5:
            threading.Event().wait(random.random() / 2000)
        rig.lifecycle.fault(Watchdog("rank 3 stopped answering"))
        done.set()

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def blocking(started: threading.Event, done: threading.Event, then: Callable[[], object] | None = None) -> Callable:
    def work() -> object:
        started.set()
        done.wait(5)
        return then() if then is not None else None

    return work


def to_dropped(rig: Rig) -> None:
    rig.lifecycle.pause_grads()
    rig.lifecycle.update_weights()
    rig.lifecycle.drop_params()


def assert_faulted_by_the_watchdog(rig: Rig, failed: pytest.ExceptionInfo[ActionFailed]) -> None:
    lc = rig.lifecycle
    assert isinstance(failed.value.cause, Watchdog), failed.value
    assert lc.phase is Phase.FAULTED and lc.fault_cause is failed.value.cause
    with pytest.raises(IllegalTransition):
        lc.restore()
    lc.recover()
    assert lc.phase is Phase.TRAIN and lc.fault_cause is None
    cycle(rig)


@pytest.mark.parametrize("work_raises", [False, True], ids=["work-returns", "work-raises-after"])
def test_a_fault_during_a_rollout_lands_when_the_rollout_ends(work_raises: bool) -> None:
    def dies() -> None:
        raise ConnectionError("the engine went away too")

    for _ in range(ROUNDS):
        rig = make_rig()
        to_dropped(rig)
        started, done = threading.Event(), threading.Event()
        watchdog = fault_from_another_thread(rig, started, done)
        with pytest.raises(ActionFailed) as failed:
            rig.lifecycle.rollout(blocking(started, done, dies if work_raises else None))
        watchdog.join()
        if work_raises:
            assert "the engine went away too" in "".join(getattr(failed.value.cause, "__notes__", []))
        assert_faulted_by_the_watchdog(rig, failed)


def test_a_fault_during_the_push_never_lands_in_weights_synced() -> None:
    for _ in range(ROUNDS // 4):
        push_with_a_fault_meanwhile()


def push_with_a_fault_meanwhile() -> None:
    rig = make_rig()
    started, done = threading.Event(), threading.Event()
    push = rig.transport.push

    def slow_push(version: int) -> object:
        blocking(started, done)()
        return push(version)

    rig.transport.push = slow_push  # type: ignore[method-assign,assignment]
    watchdog = fault_from_another_thread(rig, started, done)
    rig.lifecycle.pause_grads()
    with pytest.raises(ActionFailed) as failed:
        rig.lifecycle.update_weights()
    watchdog.join()
    rig.transport.push = push  # type: ignore[method-assign]
    assert_faulted_by_the_watchdog(rig, failed)


def test_a_fault_while_recover_waits_fails_that_recover_and_keeps_the_first_cause() -> None:
    for _ in range(ROUNDS // 4):
        recover_with_a_fault_meanwhile()


def recover_with_a_fault_meanwhile() -> None:
    rig = make_rig(recover_idle_timeout_s=5.0)
    to_dropped(rig)
    rig.lifecycle.rollout()
    rig.engine.busy = True
    rig.lifecycle.fault("the trainer's health check failed")
    first = rig.lifecycle.fault_cause
    assert first is not None
    waiting, is_idle = threading.Event(), rig.engine.is_idle

    def polled() -> bool:  # recover is waiting for the engine
        waiting.set()
        return is_idle()

    def second_fault_then_idle() -> None:
        waiting.wait(5)
        threading.Event().wait(random.random() / 500)
        rig.lifecycle.fault(Watchdog("rank 5 died while recover waited"))
        rig.engine.busy = False

    rig.engine.is_idle = polled  # type: ignore[method-assign]
    thread = threading.Thread(target=second_fault_then_idle)
    thread.start()
    with pytest.raises(ActionFailed) as failed:
        rig.lifecycle.recover()
    thread.join()
    assert isinstance(failed.value.cause, Watchdog)
    assert rig.lifecycle.phase is Phase.FAULTED and rig.lifecycle.fault_cause is first
    assert any("rank 5 died" in note for note in first.__notes__)
    rig.lifecycle.recover()
    assert rig.lifecycle.phase is Phase.TRAIN and rig.lifecycle.fault_cause is None
    cycle(rig)


def test_an_event_fired_while_another_is_in_flight_is_refused_and_changes_nothing() -> None:
    rig = make_rig()
    to_dropped(rig)
    started, done = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    def second_caller() -> None:
        started.wait(5)
        try:
            rig.lifecycle.restore()
        except EventInFlight as exc:
            refused.append(exc)
        done.set()

    thread = threading.Thread(target=second_caller)
    thread.start()
    rig.lifecycle.rollout(blocking(started, done))
    thread.join()
    assert len(refused) == 1 and "restore fired while rollout is in flight" in str(refused[0])
    assert rig.lifecycle.phase is Phase.ROLLOUT
    rig.lifecycle.restore()
    assert rig.lifecycle.phase is Phase.TRAIN


def test_a_fault_after_the_action_ended_lands_after_the_transition() -> None:
    """Between the action's end and `fire` returning, the listeners run (the phase has changed):
    a fault raised there is not the action's, so the rollout stands and FAULTED follows it."""
    rig = make_rig()
    to_dropped(rig)

    class FaultsOnRollout(Listener):
        def on_transition(self, record: TransitionRecord) -> None:
            if record.event is Event.ROLLOUT:
                rig.lifecycle.fault(Watchdog("rank 3 died just after the rollout"))

    rig.lifecycle.listeners.listeners.append(FaultsOnRollout())
    rig.lifecycle.rollout()  # the rollout itself succeeded: no ActionFailed
    assert rig.lifecycle.phase is Phase.FAULTED
    assert isinstance(rig.lifecycle.fault_cause, Watchdog)
    rig.lifecycle.listeners.listeners.pop()
    rig.lifecycle.recover()
    cycle(rig)
