"""Cross-cutting concerns subscribe to the lifecycle here: tracing, logging, reports.

A listener that raises is reported once and skipped; it never breaks the lifecycle.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from guards.verdict import Verdict
from orchestrator.errors import LifecycleError
from states import Event, Mode, Phase

AttributeValue = str | bool | int | float | tuple[str, ...]

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class TransitionRecord:
    """One attempted transition, filled in as it runs. Times are `time.perf_counter_ns()`.

    `dst` is where the table's row leads (for an event with no row, `src`); the event entered it
    only if it ends in `on_transition`. A refused or failed one entered none.
    """

    event: Event
    src: Phase
    dst: Phase
    step: int
    rank: int
    mode: Mode
    started_ns: int
    ended_ns: int = 0
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    verdicts: tuple[Verdict, ...] = ()
    cause: BaseException | None = None  # why a fault happened, or why an action raised

    @property
    def seconds(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9


class Listener:
    """Hooks on the lifecycle. Override what you need; every hook defaults to nothing.

    Enter hooks (`on_step_start`, `on_begin`) run in registration order; exit hooks run in
    reverse, so a listener registered first wraps the others (tracing keeps its span current
    while the logger reads its ids).
    """

    def on_step_start(self, step: int, rank: int) -> None: ...

    def on_step_end(self, step: int, rank: int, error: BaseException | None) -> None: ...

    def on_begin(self, record: TransitionRecord) -> None:
        """An event was fired: the table and its guards are about to judge it, then its action
        runs. Exactly one of the three hooks below follows, in the same thread."""

    def on_transition(self, record: TransitionRecord) -> None:
        """The event completed and the phase is now `record.dst`."""

    def on_rejected(self, record: TransitionRecord, error: LifecycleError) -> None:
        """The event was refused (illegal or guarded); the phase did not change."""

    def on_fault(self, record: TransitionRecord, error: LifecycleError) -> None:
        """The event's action raised; the `fault` transition follows."""


class FanOut(Listener):
    """Calls every listener, isolating each from the others' failures."""

    def __init__(self, listeners: Sequence[Listener] = ()) -> None:
        self.listeners = list(listeners)
        self._reported: set[tuple[int, str]] = set()

    def _call(self, hook: str, *args: object, reverse: bool = False) -> None:
        for listener in reversed(self.listeners) if reverse else self.listeners:
            try:
                getattr(listener, hook)(*args)
            except Exception:
                key = (id(listener), hook)
                if key not in self._reported:  # once per listener and hook: a broken sink must not flood
                    self._reported.add(key)
                    _log.exception("listener %s failed in %s; the lifecycle goes on", type(listener).__name__, hook)

    def on_step_start(self, step: int, rank: int) -> None:
        self._call("on_step_start", step, rank)

    def on_step_end(self, step: int, rank: int, error: BaseException | None) -> None:
        self._call("on_step_end", step, rank, error, reverse=True)

    def on_begin(self, record: TransitionRecord) -> None:
        self._call("on_begin", record)

    def on_transition(self, record: TransitionRecord) -> None:
        self._call("on_transition", record, reverse=True)

    def on_rejected(self, record: TransitionRecord, error: LifecycleError) -> None:
        self._call("on_rejected", record, error, reverse=True)

    def on_fault(self, record: TransitionRecord, error: LifecycleError) -> None:
        self._call("on_fault", record, error, reverse=True)
