"""The cycle as a run loop reads it: one method per event, each a `fire` of that event."""

from __future__ import annotations

from typing import Any

from orchestrator.core.actions import Work
from states import Event


class CycleEvents:
    """`Lifecycle`'s event methods. `fire` admits the event, runs its action, changes phase."""

    def fire(self, event: Event, work: Work | None = None) -> Any:
        raise NotImplementedError

    def train(self, work: Work | None = None) -> Any:
        return self.fire(Event.TRAIN, work)

    def save(self, work: Work | None = None) -> Any:
        return self.fire(Event.SAVE, work)

    def pause_grads(self) -> None:
        self.fire(Event.PAUSE_GRADS)

    def update_weights(self) -> None:
        self.fire(Event.UPDATE_WEIGHTS)

    def skip_update(self) -> None:
        self.fire(Event.SKIP_UPDATE)

    def drop_params(self) -> None:
        self.fire(Event.DROP_PARAMS)

    def rollout(self, work: Work | None = None) -> Any:
        return self.fire(Event.ROLLOUT, work)

    def restore(self) -> None:
        self.fire(Event.RESTORE)

    def recover(self) -> None:
        """Leave FAULTED for TRAIN by reconciling what is resident (docs/lifecycle.md, recovery).

        Raises ActionFailed (its cause a RecoveryRefused naming what does not hold, or the
        adapter's error) with the lifecycle still FAULTED and the first cause kept.
        """
        self.fire(Event.RECOVER)
