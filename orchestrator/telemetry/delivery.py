"""What an OTLP exporter could not deliver: counted, and told once.

An OTLP endpoint that does not take the spans is told once, not once per batch: the exporter is
wrapped (`Counted`) so that a failed export counts its spans as dropped in a `Delivery` and the
first failure warns, one line naming the endpoint. The SDK's own warnings of failed exports (one
per retry) are kept off by a logging filter added once per process to the OTLP exporters'
loggers, the first time a provider with an OTLP exporter is built; the reason the SDK gives is
kept, and the warning quotes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# The loggers the OTLP exporters report a failed export on, once per retry
SDK_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
)

_log = logging.getLogger(__name__)


class Delivery:
    """What one process's OTLP exports delivered and dropped; the first failure is told to `warn`,
    once, naming `endpoint`. Counted from the exporter's thread, read from any."""

    def __init__(self, warn: Callable[[str], None] | None = None) -> None:
        self.warn = warn or _log.warning
        self.endpoint = "the OTLP endpoint"
        self.delivered = self.dropped = 0
        self._taken = 0
        self._told = False
        self._lock = threading.Lock()

    def exported(self, spans: int, ok: bool, reason: str | None) -> None:
        with self._lock:
            if ok:
                self.delivered += spans
                return
            self.dropped += spans
            tell, self._told = not self._told, True
        if tell:
            why = f" ({_short(reason)})" if reason else ""
            self.warn(
                f"spans to {self.endpoint} are not being delivered{why}; the run goes on, "
                "and its report counts the spans dropped"
            )

    def take(self) -> int:
        """The spans dropped since the last `take`."""
        with self._lock:
            new, self._taken = self.dropped - self._taken, self.dropped
            return new


def _short(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else f"{line[: limit - 3]}..."


_reason = threading.local()  # the SDK's last word on a failed export, in the thread that exported


class _KeepReason(logging.Filter):
    """Takes the OTLP exporter's warnings and errors off the log, keeping the first of an export as its reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if getattr(_reason, "text", None) is None:  # the first is the specific one (the retry's cause)
            _reason.text = record.getMessage()
        return False


_quieted = threading.Lock()


def quiet_sdk_export_logs() -> None:
    """Once per process: the filter on the OTLP exporters' loggers (process-global, set at setup)."""
    with _quieted:
        for name in SDK_EXPORT_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _KeepReason) for f in logger.filters):
                logger.addFilter(_KeepReason())


class Counted(SpanExporter):
    """`inner`, with each export's spans counted in `delivery` as delivered or dropped."""

    def __init__(self, inner: SpanExporter, delivery: Delivery) -> None:
        self.inner, self.delivery = inner, delivery
        endpoint = getattr(inner, "_endpoint", None)
        if isinstance(endpoint, str) and endpoint:
            delivery.endpoint = endpoint

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        _reason.text = None
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # the batch processor would log it per batch: counted here instead
            result, _reason.text = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        self.delivery.exported(len(spans), result is SpanExportResult.SUCCESS, getattr(_reason, "text", None))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
