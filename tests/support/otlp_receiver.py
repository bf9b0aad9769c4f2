"""A real OTLP/HTTP receiver (OpenTelemetry's own oteltest sink) on loopback, keeping every span
with the process (role, rank) that sent it."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

from oteltest.sink import HttpSink
from oteltest.sink.handler import RequestHandler


class Collect(RequestHandler):
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.services: set[tuple[str, str, str]] = set()

    def handle_logs(self, request: Any, headers: Any) -> None: ...

    def handle_metrics(self, request: Any, headers: Any) -> None: ...

    def handle_trace(self, request: Any, headers: Any) -> None:
        for resource in request.resource_spans:
            where = {a.key: a.value for a in resource.resource.attributes}
            role = where["colocate.role"].string_value
            self.services.add(
                (role, where["service.name"].string_value, where["deployment.environment.name"].string_value)
            )
            rank = where["colocate.rank"].int_value if "colocate.rank" in where else None  # the engine has none
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: a.value for a in span.attributes}
                    self.spans.append(
                        {
                            "role": role,
                            "rank": rank,
                            "name": span.name,
                            "trace": span.trace_id.hex(),
                            "id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "attributes": attributes,
                        }
                    )


@contextlib.contextmanager
def receiver() -> Iterator[tuple[Collect, str]]:
    """While the block runs: what the receiver collects, and its endpoint (OTEL_EXPORTER_OTLP_ENDPOINT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    handler = Collect()
    sink = HttpSink(handler, logging.getLogger("oteltest"), port=port)
    sink.start()
    try:
        yield handler, f"http://127.0.0.1:{port}"
    finally:
        sink.stop()
