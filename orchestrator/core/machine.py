"""The `transitions` machine built from `states.TABLE`: which events are legal in which phase, and
what runs when one is admitted.

Each row becomes one transition: its guards are the condition (pure functions of the snapshot the
lifecycle takes), and its action runs before the phase changes. `Lifecycle` fires events into it
and reports what happened; nothing else declares transitions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from transitions import EventData, Machine

from guards import GUARDS, evaluate
from orchestrator.core.actions import Action, Work
from orchestrator.errors import ConfigError
from orchestrator.telemetry.listeners import TransitionRecord
from states import INITIAL, TABLE, Event, Phase, Snapshot, Transition


@dataclass(slots=True)
class Firing:
    """One event on its way through the machine: handed to every callback by `trigger(...)`."""

    record: TransitionRecord
    work: Work | None = None
    result: Any = None


class _Model:
    """The `transitions` model. Kept apart so its trigger methods never shadow the public API."""

    state: Phase
    trigger: Callable[..., bool]  # added by Machine


class PhaseMachine:
    """One rank's phase, moved only along the rows of `states.TABLE`.

    `snapshot(row)` is what the guards of `row` judge; `end` is told after an admitted event's action
    returned, before the phase changes (it may raise to stop the change); `actions` maps the names
    the table gives to what they do.
    """

    def __init__(
        self,
        actions: Mapping[str, Action],
        snapshot: Callable[[Transition], Snapshot],
        end: Callable[[], None] = lambda: None,
    ) -> None:
        self._actions, self._snapshot, self._end = actions, snapshot, end
        self.rows = {(row.source, row.event): row for row in TABLE}
        self._model = _Model()
        self._machine = Machine(
            model=self._model,
            states=Phase,
            transitions=[self._spec(row) for row in TABLE],
            initial=INITIAL,
            auto_transitions=False,
            send_event=True,
        )

    @property
    def phase(self) -> Phase:
        return self._model.state

    def legal_events(self, phase: Phase) -> tuple[Event, ...]:
        return tuple(event for (source, event) in self.rows if source is phase)

    def trigger(self, event: Event, firing: Firing) -> bool:
        """Run `event` through its row: False if a guard refused it (phase unchanged)."""
        return self._model.trigger(event.value, firing)

    def _spec(self, row: Transition) -> dict[str, Any]:
        unknown = [g for g in row.guards if g not in GUARDS] + (
            [row.action] if row.action and row.action not in self._actions else []
        )
        if unknown:
            raise ConfigError([f"table row {row.source}.{row.event} names unknown {name!r}" for name in unknown])
        return {
            "trigger": row.event.value,
            "source": row.source,
            "dest": row.dest,
            "conditions": [partial(self._admit, row)],
            "before": [partial(self._act, row)],
        }

    def _admit(self, row: Transition, event: EventData) -> bool:
        if not row.guards:
            return True  # nothing to judge: a fault must get through even with the engine dead
        firing: Firing
        (firing,) = event.args  # what fire() handed to trigger(...)
        firing.record.verdicts = evaluate((GUARDS[name] for name in row.guards), self._snapshot(row))
        return all(v.ok for v in firing.record.verdicts)

    def _act(self, row: Transition, event: EventData) -> None:
        firing: Firing
        (firing,) = event.args
        if row.action is not None:
            firing.result = self._actions[row.action](firing.record, firing.work)
            self._end()
