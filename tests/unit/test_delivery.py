"""An OTLP exporter that cannot deliver (issue 42, item 5): `Counted` counts each failed batch's
spans as dropped, and its `Delivery` warns once, quoting the SDK's first word on the failure,
which the SDK's logger itself no longer prints."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from orchestrator.telemetry.delivery import SDK_EXPORT_LOGGERS, Counted, Delivery, quiet_sdk_export_logs


class Refusing(SpanExporter):
    """Fails every batch as the HTTP exporter does: a warning per retry on its logger, then FAILURE
    (or, with `raises`, an exception)."""

    _endpoint = "http://127.0.0.1:9/v1/traces"

    def __init__(self, raises: bool = False) -> None:
        self.raises = raises

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        sdk = logging.getLogger(SDK_EXPORT_LOGGERS[0])
        sdk.warning("Transient error Connection refused, retrying")
        sdk.error("Failed to export spans batch due to timeout, max retries or shutdown.")
        if self.raises:
            raise ConnectionError("refused")
        return SpanExportResult.FAILURE


@pytest.mark.parametrize("raises", [False, True], ids=["failure", "raises"])
def test_every_dropped_span_is_counted_and_told_once(raises: bool, caplog: pytest.LogCaptureFixture) -> None:
    told: list[str] = []
    delivery = Delivery(warn=told.append)
    quiet_sdk_export_logs()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Counted(Refusing(raises), delivery)))
    tracer = provider.get_tracer("test")
    with caplog.at_level(logging.WARNING):
        for n in range(5):
            with tracer.start_as_current_span(f"s{n}"):
                pass
    provider.shutdown()
    assert delivery.dropped == 5 and delivery.delivered == 0 and delivery.take() == 5 and delivery.take() == 0
    assert len(told) == 1, told
    reason = "ConnectionError: refused" if raises else "Transient error Connection refused, retrying"
    assert told[0].startswith(f"spans to http://127.0.0.1:9/v1/traces are not being delivered ({reason})"), told
    assert not [r for r in caplog.records if r.name in SDK_EXPORT_LOGGERS], caplog.records
