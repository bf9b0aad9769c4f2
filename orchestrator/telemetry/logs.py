"""Each transition as one structlog line with fixed keys.

Keys: `event` (the lifecycle event), `src`, `dst`, `step`, `rank`, `mode`, `seconds`,
`trace_id`, `span_id`, then the action's own attributes without their `colocate.` prefix.
Refusals log at warning with `refused`; failed actions at error with `cause`. Both have `dst`
null: the event entered no phase (a failed one's FAULTED is the `fault` line that follows).
`trace_id` and `span_id` are those of the transition's own span.

Every other line (an adapter's `noop` or `leftover` note) is a note: it carries the ids of the
span current where it was written. The rank and engine processes write none themselves: each
keeps its lines (`keep_lines`) until the driver takes them (`forward`), with each call's answer,
or after a call that failed, and writes them into its own log, each naming its `process`. Notes
at warning and above are also handed to the run's `warn` (stderr): a transition's refusal or
fault is not, the run says those itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, MutableMapping
from typing import IO, Any

import structlog
from opentelemetry import trace

from orchestrator.errors import ActionFailed, GuardRejected, LifecycleError
from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import Listener, TransitionRecord

LIFECYCLE = "colocate"  # the logger of the transitions' lines
NOTES = "colocate.notes"  # the logger of every other line: adapters' notes, other processes' lines
Line = dict[str, Any]  # one line's keys, as a process hands them to the driver
_STAMP = structlog.processors.TimeStamper(fmt="iso", utc=True)


def _ids() -> dict[str, str | None]:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {"trace_id": None, "span_id": None}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def _keys(record: TransitionRecord, *, entered: bool = True) -> dict[str, Any]:
    return {
        "src": record.src.value,
        "dst": record.dst.value if entered else None,
        "step": record.step,
        "rank": record.rank,
        "mode": record.mode.value,
        "seconds": round(record.seconds, 6),
        **_ids(),
        **{k.removeprefix(semconv.PREFIX): v for k, v in record.attributes.items()},
    }


def _stamp(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The time now, on a line that has none: a forwarded line keeps the time it was written."""
    return event_dict if "timestamp" in event_dict else _STAMP(logger, method, event_dict)


def _span_ids(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The current span's ids, on a line that names none (a transition's line names its own)."""
    if "trace_id" not in event_dict:
        event_dict.update(_ids())
    return event_dict


class StepBufferedLogger:
    """A structlog logger that writes JSON lines and leaves flushing to the step boundary.

    structlog's WriteLogger flushes every line: one syscall per transition. This one is flushed
    by `LoggingListener` at the end of every step and on every fault, and by `close()`.
    """

    def __init__(self, file: IO[str]) -> None:
        self._file, self._lock = file, threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            self._file.write(message + "\n")

    log = debug = info = warn = warning = error = critical = exception = fatal = msg

    def flush(self) -> None:
        with self._lock:
            self._file.flush()


class NoteLogger:
    """Writes each note into the log (where there is one) and hands a warning or worse to `warn`."""

    __slots__ = ("_sink", "_warn")

    def __init__(self, sink: StepBufferedLogger | None, warn: Callable[[str], None] | None) -> None:
        self._sink, self._warn = sink, warn

    def msg(self, message: str) -> None:
        if self._sink is not None:
            self._sink.msg(message)

    def warning(self, message: str) -> None:
        self.msg(message)
        if self._warn is not None:
            self._warn(message)

    log = debug = info = msg
    warn = error = critical = exception = fatal = warning


def configure_logging(file: IO[str] | None, *, warn: Callable[[str], None] | None = None) -> StepBufferedLogger | None:
    """Render colocate's log lines as JSON into `file` (None: none), flushed per step, and hand
    each note at warning or above to `warn` too (the run's stderr)."""
    sink = StepBufferedLogger(file) if file is not None else None
    notes = NoteLogger(sink, warn)
    structlog.configure(
        processors=[structlog.processors.add_log_level, _stamp, _span_ids, structlog.processors.JSONRenderer()],
        logger_factory=lambda name=None, *_: sink if name == LIFECYCLE and sink is not None else notes,
        cache_logger_on_first_use=True,
    )
    return sink


class LineBuffer:
    """A structlog logger that keeps each line's keys, in a process whose lines the driver writes."""

    __slots__ = ("_lines", "_lock")

    def __init__(self) -> None:
        self._lines: list[Line] = []
        self._lock = threading.Lock()  # a call's thread, the control thread and an adapter's own threads

    def msg(self, line: Line) -> None:
        with self._lock:
            self._lines.append(line)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg

    def take(self) -> list[Line]:
        """Every line kept since the last take, oldest first; each is handed out once."""
        with self._lock:
            lines, self._lines = self._lines, []
        return lines


class _Process:
    """Names the process a line was written in."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event_dict["process"] = self.name
        return event_dict


def _kept(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> tuple[tuple[Line], dict[str, Any]]:
    return (dict(event_dict),), {}  # the keys themselves, for `LineBuffer.msg`


def keep_lines(process: str) -> LineBuffer:
    """In a rank's or engine's own process, once, at its start: its lines, stamped with the time,
    the current span's ids and `process`, are kept for the driver to take (`LineBuffer.take`)."""
    lines = LineBuffer()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,  # the traceback as text: the driver has no exception
            _stamp,
            _span_ids,
            _Process(process),
            _kept,
        ],
        logger_factory=lambda *_: lines,
        cache_logger_on_first_use=True,
    )
    return lines


def forward(lines: Iterable[Line]) -> None:
    """Another process's lines (`LineBuffer.take`), written by this process's logger as notes, at
    their own level, with the time they were written."""
    log = structlog.get_logger(NOTES)
    for line in lines:
        keys = dict(line)
        level, event = keys.pop("level", "info"), keys.pop("event", "")
        getattr(log, level if level in _LEVELS else "info")(event, **keys)


_LEVELS = frozenset({"debug", "info", "warning", "error", "critical"})


class LoggingListener(Listener):
    """Register after the TracingListener so the transition's span is current when this logs."""

    def __init__(self, logger: Any = None, sink: StepBufferedLogger | None = None) -> None:
        self._log = logger if logger is not None else structlog.get_logger(LIFECYCLE)
        self._sink = sink  # flushed at each step's end and on faults

    def _flush(self) -> None:
        if self._sink is not None:
            self._sink.flush()

    def on_step_end(self, step: int, rank: int, error: BaseException | None) -> None:
        self._flush()

    def on_transition(self, record: TransitionRecord) -> None:
        self._log.info(record.event.value, **_keys(record))

    def on_rejected(self, record: TransitionRecord, error: LifecycleError) -> None:
        refused = [str(v) for v in error.verdicts] if isinstance(error, GuardRejected) else [str(error)]
        self._log.warning(record.event.value, **_keys(record, entered=False), refused=refused)

    def on_fault(self, record: TransitionRecord, error: LifecycleError) -> None:
        cause = error.cause if isinstance(error, ActionFailed) else error
        self._log.error(record.event.value, **_keys(record, entered=False), cause=f"{type(cause).__name__}: {cause}")
        self._flush()


def note_noop(component: str, call: str, why: str) -> None:
    """An adapter call that found its work already done (a pause of a paused tag, a release of
    released memory): logged as a warning line, not raised. After a call that took effect and
    then failed, recover makes such calls on purpose; each one leaves this note."""
    structlog.get_logger(NOTES).warning("noop", component=component, call=call, why=why)


def note_leftover(component: str, found: str, done: str) -> None:
    """State an earlier run left on a server (an open weight-update session, a weight-update group
    of the name this run uses) and what this run did about it: a warning line, not raised."""
    structlog.get_logger(NOTES).warning("leftover", component=component, found=found, done=done)
