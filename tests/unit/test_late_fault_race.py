"""A fault that lands late has the phase to itself (issue 42, item 1).

A fault raised once an event's action has ended (here: from a listener's `on_transition`) lands
just after the transition, before `fire` returns. That landing is a write of the phase, so nothing
else may act while it runs: not a second `fault()` (which would write FAULTED first and leave the
landing to trigger `fault` out of FAULTED: an untyped `MachineError`, and the second cause lost),
and not another event (which would run in a phase that is about to be FAULTED).

The deterministic tests hold the landing open in its `on_begin` until the other thread has either
finished its call or is waiting on the latch's lock: a probe on that lock tells which, so nothing
here is timed. The stress test leaves the threads unscheduled, with a tiny switch interval.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

import pytest

from orchestrator import ActionFailed, EventInFlight, IllegalTransition, Lifecycle, Listener, TransitionRecord
from states import Event, Phase
from tests.support.rig import Rig, make_rig

SAFETY_S = 30.0  # a hang guard only: every wait below is released by an event, never by time


class Watchdog(RuntimeError):
    """A rank died, as another thread saw it."""


class ProbedLock:
    """The latch's lock, telling `waiting` when a thread finds it taken and has to wait for it."""

    def __init__(self, lock: threading.RLock, waiting: threading.Event) -> None:
        self._lock, self._waiting = lock, waiting

    def __enter__(self) -> ProbedLock:
        if not self._lock.acquire(blocking=False):  # an RLock: only another thread's hold refuses
            self._waiting.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._lock.release()


def probe(lc: Lifecycle, waiting: threading.Event) -> None:
    lc._latch._lock = ProbedLock(lc._latch._lock, waiting)  # type: ignore[assignment]


class LateFault(Listener):
    """Faults `late` once `train` has landed; while that fault lands (its `on_begin`), runs `meanwhile`."""

    def __init__(self, lc: Lifecycle, late: BaseException, meanwhile: Callable[[], None]) -> None:
        self.lc, self.late, self.meanwhile = lc, late, meanwhile

    def on_transition(self, record: TransitionRecord) -> None:
        if record.event is Event.TRAIN:
            self.lc.fault(self.late)

    def on_begin(self, record: TransitionRecord) -> None:
        if record.event is Event.FAULT and record.cause is self.late:
            self.meanwhile()


@contextmanager
def another_thread_during_the_landing(rig: Rig, late: BaseException, call: Callable[[], object]) -> Iterator[dict]:
    """While `late` lands, `call` runs in another thread; the landing goes on once that call has
    returned (or raised) or is waiting on the latch. Yields what the call did: `returned` or `raised`."""
    lc = rig.lifecycle
    arrived, outcome = threading.Event(), {}
    probe(lc, arrived)

    def other() -> None:
        try:
            outcome["returned"] = call()
        except BaseException as exc:
            outcome["raised"] = exc
        finally:
            arrived.set()

    thread = threading.Thread(target=other)

    def meanwhile() -> None:
        thread.start()
        assert arrived.wait(SAFETY_S)

    lc.listeners.listeners.append(LateFault(lc, late, meanwhile))
    try:
        yield outcome
    finally:
        lc.listeners.listeners.pop()
        thread.join(SAFETY_S)
        assert not thread.is_alive()


def test_a_fault_from_another_thread_while_a_late_fault_lands_is_noted_and_refused() -> None:
    """(a): the second fault finds the lifecycle FAULTED by the first: refused, its cause a note."""
    rig = make_rig()
    lc = rig.lifecycle
    late, second = Watchdog("rank 3 died just after the step"), Watchdog("rank 5 died too")
    with another_thread_during_the_landing(rig, late, lambda: lc.fault(second)) as outcome:
        assert lc.train(lambda: "stepped") == "stepped"  # the step itself stood: the fault came after it
    assert lc.phase is Phase.FAULTED and lc.fault_cause is late
    assert any("rank 5 died too" in note for note in late.__notes__), late.__notes__
    assert isinstance(outcome.get("raised"), IllegalTransition), outcome
    lc.recover()
    assert lc.phase is Phase.TRAIN


def test_an_event_from_another_thread_while_a_late_fault_lands_is_refused() -> None:
    """(b): a second `train` waits for the landing, then finds FAULTED: no second optimizer step."""
    rig = make_rig()
    lc = rig.lifecycle
    late, steps = Watchdog("rank 3 died just after the step"), []
    with another_thread_during_the_landing(rig, late, lambda: lc.train(lambda: steps.append("second"))) as outcome:
        lc.train(lambda: steps.append("first"))
    assert steps == ["first"], steps
    assert isinstance(outcome.get("raised"), IllegalTransition), outcome
    assert lc.phase is Phase.FAULTED and lc.fault_cause is late


def test_a_fault_raised_inside_a_landing_is_noted_on_the_cause_being_landed() -> None:
    """The same thread re-entering: a listener of the landing faults again. The landing is in
    flight, so the new cause is held and becomes a note; nothing triggers `fault` out of FAULTED."""
    rig = make_rig()
    lc = rig.lifecycle
    first, again = Watchdog("the health check failed"), Watchdog("and the heartbeat stopped")

    class FaultsAgain(Listener):
        def on_begin(self, record: TransitionRecord) -> None:
            if record.event is Event.FAULT and record.cause is first:
                lc.fault(again)

    lc.listeners.listeners.append(FaultsAgain())
    lc.fault(first)
    assert lc.phase is Phase.FAULTED and lc.fault_cause is first
    assert any("and the heartbeat stopped" in note for note in first.__notes__), first.__notes__


# ---- unscheduled -------------------------------------------------------------------------------

TRIES = int(os.environ.get("COLOCATE_LATE_FAULT_TRIES", "20000"))
LIFECYCLE_ERRORS = (ActionFailed, IllegalTransition, EventInFlight)


def one_try(rig: Rig, what: str) -> list[str]:
    """One unscheduled race: train (faulted late by a listener) against a fault or a train from
    another thread released once the first train's work ran. Returns what went wrong."""
    lc = rig.lifecycle
    late, second = Watchdog("late"), Watchdog("second")
    began, steps, errors = threading.Event(), [], []

    def other() -> None:
        began.wait(SAFETY_S)
        try:
            if what == "fault":
                lc.fault(second)
            else:
                lc.train(lambda: steps.append("second"))
        except LIFECYCLE_ERRORS:
            pass
        except BaseException as exc:
            errors.append(f"the other thread's {what}: {type(exc).__name__}: {exc}")

    def first_step() -> None:
        steps.append("first")
        began.set()

    thread = threading.Thread(target=other)
    thread.start()
    listener = LateFault(lc, late, lambda: None)
    lc.listeners.listeners.append(listener)
    try:
        lc.train(first_step)
    except ActionFailed as failed:
        if failed.cause is not second:
            errors.append(f"train failed with {failed.cause!r}, not the other thread's fault")
    except BaseException as exc:
        errors.append(f"train: {type(exc).__name__}: {exc}")
    finally:
        thread.join(SAFETY_S)
        lc.listeners.listeners.remove(listener)
    cause = lc.fault_cause
    if lc.phase is not Phase.FAULTED:
        errors.append(f"ended in {lc.phase}")
    elif what == "fault":
        named = f"{cause}\n" + "\n".join(getattr(cause, "__notes__", []))
        if cause not in (late, second) or (cause is late and "second" not in named):
            errors.append(f"the other thread's fault was lost: cause {cause!r}, notes {named!r}")
    elif cause is not late:
        errors.append(f"first cause {cause!r}, not the late fault")
    if steps != ["first"]:
        errors.append(f"steps run: {steps}")
    lc.recover()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("what", ["fault", "train"])
def test_unscheduled_races_with_a_landing_go_wrong_never(what: str) -> None:
    rig = make_rig()
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        wrong = [found for _ in range(TRIES) if (found := one_try(rig, what))]
    finally:
        sys.setswitchinterval(before)
    assert not wrong, f"{len(wrong)} of {TRIES} tries went wrong, the first: {wrong[0]}"
