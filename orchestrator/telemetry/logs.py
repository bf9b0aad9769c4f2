"""Each transition as one structlog line with fixed keys.

Keys: `event` (the lifecycle event), `src`, `dst`, `step`, `rank`, `mode`, `seconds`,
`trace_id`, `span_id`, then the action's own attributes without their `colocate.` prefix.
Refusals log at warning with `refused`; failed actions at error with `cause`. Both have `dst`
null: the event entered no phase (a failed one's FAULTED is the `fault` line that follows).
`trace_id` and `span_id` are those of the transition's own span.
"""

from __future__ import annotations

import threading
from typing import IO, Any

import structlog
from opentelemetry import trace

from orchestrator.errors import ActionFailed, GuardRejected, LifecycleError
from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import Listener, TransitionRecord


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


def configure_logging(file: IO[str]) -> StepBufferedLogger:
    """Render colocate's log lines as JSON into `file`, flushed per step."""
    logger = StepBufferedLogger(file)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=lambda *_: logger,
        cache_logger_on_first_use=True,
    )
    return logger


class LoggingListener(Listener):
    """Register after the TracingListener so the transition's span is current when this logs."""

    def __init__(self, logger: Any = None, sink: StepBufferedLogger | None = None) -> None:
        self._log = logger if logger is not None else structlog.get_logger("colocate")
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
    structlog.get_logger("colocate").warning("noop", component=component, call=call, why=why)


def note_leftover(component: str, found: str, done: str) -> None:
    """State an earlier run left on a server (an open weight-update session, a weight-update group
    of the name this run uses) and what this run did about it: a warning line, not raised."""
    structlog.get_logger("colocate").warning("leftover", component=component, found=found, done=done)
