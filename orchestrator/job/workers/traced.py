"""The base of every worker process: each call the driver makes is one span in the step's trace."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.telemetry.logs import Line, LineBuffer


@dataclass(frozen=True, slots=True)
class Answer:
    """A remote call's result, and the log lines its process wrote since its last answer."""

    result: Any
    lines: list[Line]


class Traced:
    """A process-side object the driver calls: every call is one span, `<role>.<method>`.

    The caller's trace context arrives as W3C headers, so the span joins the step's trace
    whichever process it runs in. A rank's spans (the nested ones too) carry its `colocate.rank`.
    """

    role = "worker"
    rank: int | None = None
    refusal: Exception | None = None  # a set-up refused while built, raised by `ready` (`pool._keeping_refusals`)
    _provider: Any = None
    _lines: LineBuffer | None = None  # in a process of its own: its log lines, until the driver takes them
    # Queries the lifecycle makes around every transition, and the driver's housekeeping: spans
    # for them would bury the work (or, for flush_traces, be roots of traces of their own).
    untraced = frozenset(
        {
            "ready", "tags", "layout", "state", "probe", "flush_traces", "device_memory", "footprint",
            "region_bytes", "unallocated_bytes", "until_exit", "take_lines",
        }
    )  # fmt: skip

    def start_tracing(self, trace_file: str | None, rank: int | None = 0) -> None:
        """In a process of its own: a tracer provider of this role and rank, from the `OTEL_*`
        variables and `trace_file`, set as the global one (nothing if neither asks for spans)."""
        from opentelemetry import trace

        from orchestrator.telemetry.tracing import configure_tracing

        path = Path(trace_file) if trace_file else None
        self._provider = configure_tracing(rank=rank, trace_file=path, role=self.role)
        if self._provider is not None:
            trace.set_tracer_provider(self._provider)

    def start_logging(self, process: str) -> None:
        """In a process of its own: keep its log lines, named `process`, for the driver, which
        writes them into the run's log (`telemetry.logs.forward`)."""
        from orchestrator.telemetry.logs import keep_lines

        self._lines = keep_lines(process)

    def call(self, headers: dict[str, str], method: str, *args: Any, **kwargs: Any) -> Answer:
        """`invoke` from the driver (`WorkerPool`), answered with the lines written since the
        last answer. A call that raises leaves its lines for `take_lines`."""
        result = self.invoke(headers, method, *args, **kwargs)
        return Answer(result, self.take_lines())

    def take_lines(self) -> list[Line]:
        """The log lines written since they were last taken (on the control thread, after a call
        that failed or before the process ends)."""
        return self._lines.take() if self._lines is not None else []

    def invoke(self, headers: dict[str, str], method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` under the caller's trace context. `WorkerPool` is the one caller: it
        names the method from a typed reference (`TrainerRank.stash`), checked by mypy."""
        from orchestrator.telemetry import semconv
        from orchestrator.telemetry.tracing import continued, process_span

        if method in self.untraced:
            return getattr(self, method)(*args, **kwargs)
        with continued(headers, rank=self.rank), process_span(f"{self.role}.{method}") as span:
            result = getattr(self, method)(*args, **kwargs)
            if isinstance(result, int) and not isinstance(result, bool):
                span.set_attribute(semconv.BYTES, result)
            return result

    def ready(self) -> int:
        """This process's id, once the worker is built."""
        return os.getpid()

    def probe(self) -> int:
        """This process's id. Called on the control thread, so a process whose work is blocked
        (in a collective waiting for a peer) still answers, and one that is stopped or dead does not."""
        return os.getpid()

    def until_exit(self) -> None:
        """Return never: called on a thread of its own, its call fails the moment this process
        dies, whatever else the driver waits on then (`pool.Sentinels`)."""
        threading.Event().wait()

    def flush_traces(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()
