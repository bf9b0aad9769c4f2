"""One writer of the phase: the thread that fires an event.

A fault can come from anywhere: a watchdog thread, a rank monitor, the action's own work. While
an event is in flight its action owns the phase, so a fault is held here rather than written
over it; when the action ends the event lands in FAULTED instead of its destination, and its
caller gets `ActionFailed` carrying that fault. A fault that arrives after the action ended (the
phase is about to change) lands just after the transition, before `fire` returns.

A landing writes the phase too, so it runs under the lock with the mark still set (to `fault`):
another thread's event or fault waits for it and then finds FAULTED (refused; a fault's cause
becomes a note), and a fault raised by a listener of the landing itself, in its own thread, is
held and noted once the landing is done. Nothing acts between a landing's check of the phase and
its write.
"""

from __future__ import annotations

import threading
from typing import Protocol

from orchestrator.errors import EventInFlight
from states import Event


class Held(Exception):
    """Raised at an action's end to stop its transition: `cause` arrived while it ran."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class Land(Protocol):
    """Write FAULTED with `cause`; already FAULTED, note it (and refuse, if `refuse`)."""

    def __call__(self, cause: BaseException, /, *, refuse: bool) -> None: ...


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

    def offer(self, cause: BaseException, land: Land) -> bool:
        """Hold `cause` for the event in flight (True), or, with none in flight, `land` it now under
        the lock, so no event can begin meanwhile (False). A second cause held becomes a note."""
        with self._lock:
            if self._event is None:
                self._settle(cause, land, refuse=True)
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

    def end(self, land: Land) -> None:
        """The event is no longer in flight. A cause that arrived after its action ended lands
        first, before the mark is cleared and under the lock: nothing can act in between."""
        with self._lock:
            try:
                if (late := self.take()) is not None:
                    self._settle(late, land, refuse=False)
            finally:
                self._event = None

    def _settle(self, cause: BaseException, land: Land, *, refuse: bool) -> None:
        """Land `cause` (under the lock) with the landing in flight: a fault raised meanwhile, by a
        listener of the landing, is held, and lands after it, a note on the cause kept."""
        event, self._event = self._event, Event.FAULT
        try:
            land(cause, refuse=refuse)
        finally:
            try:
                while (later := self.take()) is not None:
                    land(later, refuse=False)
            finally:
                self._event = event
