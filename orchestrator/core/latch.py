"""One writer of the phase: the thread that fires an event.

A fault can come from anywhere: a watchdog thread, a rank monitor, the action's own work. While
an event is in flight its action owns the phase, so a fault is held here rather than written
over it; when the action ends the event lands in FAULTED instead of its destination, and its
caller gets `ActionFailed` carrying that fault. A fault that arrives after the action ended (the
phase is about to change) lands just after the transition, before `fire` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from orchestrator.errors import EventInFlight
from states import Event


class Held(Exception):
    """Raised at an action's end to stop its transition: `cause` arrived while it ran."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class FaultLatch:
    """Which event is in flight, and the fault held for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entered by a fault raised from inside the landing
        self._event: Event | None = None
        self._held: BaseException | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> FaultLatch:
        """A copy (of a whole lifecycle, say) gets a lock of its own."""
        copy = FaultLatch()
        with self._lock:
            copy._event, copy._held = self._event, self._held
        return copy

    def begin(self, event: Event) -> None:
        with self._lock:
            if self._event is not None:
                raise EventInFlight(event, self._event)
            self._event, self._held = event, None

    def offer(self, cause: BaseException, land: Callable[[], None]) -> bool:
        """Hold `cause` for the event in flight (True), or, with none in flight, `land` it now under
        the lock, so no event can begin meanwhile (False). A second cause held becomes a note."""
        with self._lock:
            if self._event is None:
                land()
                return False
            if self._held is None:
                self._held = cause
            else:
                self._held.add_note(f"a later fault, during {self._event.value}: {type(cause).__name__}: {cause}")
            return True

    def take(self) -> BaseException | None:
        """The cause held so far, handed over once."""
        with self._lock:
            held, self._held = self._held, None
            return held

    def check(self) -> None:
        """At an action's end: raise `Held` if a fault arrived while it ran."""
        held = self.take()
        if held is not None:
            raise Held(held)

    def end(self) -> BaseException | None:
        """The event is no longer in flight; returns a cause that arrived after its action ended."""
        with self._lock:
            self._event = None
            return self.take()
