"""The base of every worker process: each call the driver makes is one span in the step's trace."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


class Traced:
    """A process-side object the driver calls: every call is one span, `<role>.<method>`.

    The caller's trace context arrives as W3C headers, so the span joins the step's trace
    whichever process it runs in. A rank's spans (the nested ones too) carry its `colocate.rank`.
    """

    role = "worker"
    rank: int | None = None
    _provider: Any = None
    # Queries the lifecycle makes around every transition, and the driver's housekeeping: spans
    # for them would bury the work (or, for flush_traces, be roots of traces of their own).
    untraced = frozenset(
        {
            "ready", "tags", "layout", "state", "probe", "flush_traces", "device_memory", "footprint",
            "region_bytes", "unallocated_bytes", "until_exit",
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
