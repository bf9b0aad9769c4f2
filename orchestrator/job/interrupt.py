"""Ctrl-C for the whole life of a `colocate` process.

The handler is installed once, by the CLI's entry point, and never swapped per call. The first
SIGINT only asks the run to stop: the step in flight finishes, so no KeyboardInterrupt lands inside
a Ray call, a collective or a span flush, and the report keeps every finished step. A second SIGINT
stops at once, as Python's default handler would. Start-up has no step to finish: its waits (for
`ray start`, for the actors to be built) look at the request every `POLL_S` and end it there
(`check`), leaving nothing it started running.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

POLL_S = 0.1  # how often a wait of start-up looks at the request


class CtrlC:
    def __init__(self) -> None:
        self.requested = threading.Event()

    def install(self) -> None:
        """Call once, from the main thread, before any work starts."""
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()


CTRL_C = CtrlC()


def check(stop: threading.Event | None) -> None:
    """Raise KeyboardInterrupt if `stop` (`CTRL_C.requested`, in a run) is set."""
    if stop is not None and stop.is_set():
        raise KeyboardInterrupt
