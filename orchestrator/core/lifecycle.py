"""The lifecycle controller: the event API over one machine built from `states.TABLE` (core/machine.py).

An event is admitted only if the table has a row for it in the current phase and every guard of
that row accepts the current snapshot. Its action then moves memory through the adapters; if
the action raises, the controller goes to FAULTED and keeps the cause. Nothing but `recover`
is legal there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from guards import READS, refusals
from orchestrator.core.actions import Actions, Work
from orchestrator.core.config import LifecycleConfig
from orchestrator.core.events import CycleEvents
from orchestrator.core.latch import Held
from orchestrator.core.machine import Firing, PhaseMachine
from orchestrator.core.offload import Residency, choose
from orchestrator.core.regions import RegionLedger
from orchestrator.core.state import COMPONENTS, ControllerState
from orchestrator.errors import (
    ActionFailed,
    ConfigError,
    FaultWithoutCause,
    GuardRejected,
    IllegalTransition,
    LifecycleError,
)
from orchestrator.protocols import Checkpointer, MemoryRegions, RolloutEngine, TrainerControl, WeightTransport
from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import FanOut, Listener, TransitionRecord
from states import Event, Mode, Phase, Snapshot, TrainerLayout, Transition


def require_restore_coverage(layout: TrainerLayout) -> None:
    """Every param must come back after a drop: rebuilt from a DDP buffer, or an extra."""
    if layout.uncovered:
        raise ConfigError(
            [
                f"{name}: not rebuilt from the fp32 mains and not an extra (a drop would lose it)"
                for name in layout.uncovered
            ]
        )


def check_wiring(mode: Mode, engine: RolloutEngine | None, transport: WeightTransport | None) -> None:
    """A train-only run takes neither an engine nor a transport; every other mode takes both."""
    if mode is Mode.TRAIN_ONLY:
        if engine is not None or transport is not None:
            raise ConfigError(["a train-only run takes no engine and no transport"])
    elif engine is None or transport is None:
        raise ConfigError([f"mode {mode} needs an engine and a weight transport"])


def asks(row: Transition, *, planned: bool) -> frozenset[str]:
    """The components `row`'s guards read (`guards.READS`): a memory guard without a plan admits,
    and reads nothing."""
    reads = [READS[name] for name in row.guards]
    return frozenset().union(*(r for r in reads if planned or "memory" not in r))


class Lifecycle(CycleEvents):
    """Drives one rank through train → pause_grads → update_weights → drop_params → rollout → restore.

    The engine is taken over at construction: its memory is released so the trainer starts
    alone on the device, as in the TRAIN row of the memory table (docs/lifecycle.md).
    `checkpointer`: see `step`. `resumed_version`: the loaded checkpoint's; the first sync is after it.
    """

    def __init__(
        self,
        *,
        config: LifecycleConfig,
        trainer: TrainerControl,
        regions: MemoryRegions,
        engine: RolloutEngine | None = None,
        transport: WeightTransport | None = None,
        listeners: list[Listener] | tuple[Listener, ...] = (),
        checkpointer: Checkpointer | None = None,
        resumed_version: int = 0,
    ) -> None:
        self.config, self.checkpointer = config, checkpointer
        check_wiring(config.mode, engine, transport)
        self._layout = trainer.layout()
        if config.mode is not Mode.TRAIN_ONLY:
            require_restore_coverage(self._layout)
        self.listeners = FanOut(listeners)
        # Versions continue past what an attached engine serves (an earlier job's weights) and a
        # resumed checkpoint's; the engine still serves nothing of this job's before a sync.
        served = (engine.state().weight_version or 0) if engine is not None else 0
        self.state = state = ControllerState(
            config, self._layout, trainer, regions, engine, weight_version=max(served, resumed_version)
        )
        self._known, self._latch = state.decided, state.latch
        self._regions = ledger = RegionLedger(regions, lambda: state.reading)
        self._actions = actions = Actions(config, state, trainer, ledger, engine, transport)
        self.fault_cause: BaseException | None = None
        self._machine = PhaseMachine(actions.by_name(), self._judged, self._latch.check)
        self._asks = {row: asks(row, planned=config.memory is not None) for row in self._machine.rows.values()}
        state.begin()
        actions.take_over_engine()
        # Chosen once the engine is released and every region resident: what is free then is
        # what the sleeps to come start from.
        state.decided.residency = choose(config.offload, state.begin().memory())

    # ---- reading the state -------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._machine.phase

    @property
    def weight_version(self) -> int:
        return self._known.weight_version

    @property
    def residency(self) -> Residency:
        """The offload choice made at start-up (core/offload.py)."""
        return self._known.residency

    @property
    def last_restore_verified(self) -> bool | None:
        """Whether the last restore (or recover) matched the digests of its drop; None if unchecked."""
        return self._known.last_restore_verified

    def legal_events(self, phase: Phase | None = None) -> tuple[Event, ...]:
        return self._machine.legal_events(self.phase if phase is None else phase)

    def snapshot(self) -> Snapshot:
        """What guards read, every component asked afresh."""
        self.state.begin()
        return self.state.snapshot(self.phase, frozenset(COMPONENTS))

    def _judged(self, row: Transition) -> Snapshot:
        """What `row`'s guards read: of the event's reading, only the components they name."""
        return self.state.snapshot(self.phase, self._asks[row])

    # ---- firing events -----------------------------------------------------------------------

    @contextmanager
    def step(self, number: int | None = None) -> Iterator[int]:
        """Group the transitions of one training step (one trace, one parent span); a step the
        checkpointer says is due ends with `save` (refused out of TRAIN; FAULTED if it raises)."""
        known = self._known
        known.step = known.step + 1 if number is None else number
        self.listeners.on_step_start(known.step, self.config.rank)
        try:
            yield known.step
            if (saver := self.checkpointer) is not None and saver.due(known.step):
                self.save(lambda: saver.save(known.step, known.weight_version))
        except BaseException as exc:
            self.listeners.on_step_end(known.step, self.config.rank, exc)
            raise
        self.listeners.on_step_end(known.step, self.config.rank, None)

    def _record(self, event: Event, dst: Phase) -> TransitionRecord:
        return TransitionRecord(
            event, self.phase, dst, self._known.step, self.config.rank, self.config.mode, time.perf_counter_ns()
        )

    def fire(self, event: Event, work: Work | None = None) -> Any:
        """Admit `event`, run its action (and `work`, the caller's part of it), change phase.

        Raises IllegalTransition or GuardRejected with the phase unchanged, or ActionFailed
        once the lifecycle is FAULTED: the action raised, or `fault` was called (from any
        thread) while it ran. Returns what `work` returned. A fault needs a cause: fire it
        through `fault(cause)`. One event at a time: another fired meanwhile is EventInFlight.
        """
        self._latch.begin(event)
        try:
            self.state.begin()  # what the adapters report is asked afresh for every event
            return self._fire(event, work)
        finally:
            # A fault that arrived once the action was done lands after the transition, before
            # the event stops being in flight: no other thread acts between the two.
            self._latch.end(self._land)

    def _fire(self, event: Event, work: Work | None) -> Any:
        src = self.phase
        row = self._machine.rows.get((src, event))
        record = self._record(event, row.dest if row else src)
        self.listeners.on_begin(record)  # before the table and the guards judge it: they are part of it
        if row is None:
            self._reject(record, IllegalTransition(src, event, self.legal_events(src)))
        if event is Event.FAULT:
            self._reject(record, FaultWithoutCause())
        firing = Firing(record, work)
        try:
            moved = self._machine.trigger(event, firing)
        except Exception as exc:
            self._fail(record, exc)
        if not moved:
            self._reject(record, GuardRejected(src, event, refusals(record.verdicts)))
        if event is Event.RECOVER:
            self.fault_cause = None  # kept until the invariants of TRAIN hold again
        record.ended_ns = time.perf_counter_ns()
        self.listeners.on_transition(record)
        return firing.result

    def _reject(self, record: TransitionRecord, error: LifecycleError) -> None:
        record.ended_ns = time.perf_counter_ns()
        self.listeners.on_rejected(record, error)
        raise error

    def _fail(self, record: TransitionRecord, exc: Exception) -> None:
        # A fault that arrived while the action ran is the cause, whatever the action did after.
        if isinstance(exc, Held):
            cause: BaseException = exc.cause
        elif (held := self._latch.take()) is not None:
            held.add_note(f"{record.event.value} then raised: {type(exc).__name__}: {exc}")
            cause = held
        else:
            cause = exc
        record.ended_ns = time.perf_counter_ns()
        record.cause = cause
        error = ActionFailed(record.src, record.event, cause)
        self.listeners.on_fault(record, error)
        if record.src is Phase.FAULTED and self.fault_cause is not None:
            # recover failed: the first cause stays until a recover resolves it, this one noted on it
            self.fault_cause.add_note(f"{record.event.value} failed too: {type(cause).__name__}: {cause}")
        elif record.src is not Phase.FAULTED:
            self._land(cause)
        raise error from cause

    def fault(self, cause: BaseException | str) -> None:
        """Move to FAULTED from outside (a rank died, a watchdog fired). Only `recover` leaves it.

        From any thread. While an event is in flight, its action owns the phase: the fault is
        held, and the event ends in FAULTED with this cause (its caller gets ActionFailed); during
        a recover, that recover fails. The first cause is kept in `fault_cause`; a fault while
        FAULTED is refused, and its cause becomes a note on the kept one.
        """
        if not cause:
            raise FaultWithoutCause()
        error = cause if isinstance(cause, BaseException) else RuntimeError(cause)
        self._latch.offer(error, self._land)

    def _land(self, error: BaseException, *, refuse: bool = True) -> None:
        """Write FAULTED with `error` as its cause: the phase's one writer calls this. Already
        FAULTED, the cause becomes a note on the kept one (and `fault` is refused, if `refuse`)."""
        record = self._record(Event.FAULT, Phase.FAULTED)
        record.cause = error
        record.attributes[semconv.CAUSE] = f"{type(error).__name__}: {error}"
        if self.phase is Phase.FAULTED:
            if self.fault_cause is not None:
                self.fault_cause.add_note(f"a later fault: {type(error).__name__}: {error}")
            if refuse:
                self.listeners.on_begin(record)
                self._reject(record, IllegalTransition(self.phase, Event.FAULT, self.legal_events()))
            return
        self.listeners.on_begin(record)
        self.fault_cause = error
        self._machine.trigger(Event.FAULT, Firing(record))
        record.ended_ns = time.perf_counter_ns()
        self.listeners.on_transition(record)
