"""Each transition as one OpenTelemetry span, children of one span per training step.

`configure_tracing` builds an SDK tracer provider from the standard `OTEL_*` variables and
returns None when nothing asks for export, so an unconfigured run pays for no-op spans only.

An OTLP exporter counts what it could not deliver, and says so once (`telemetry.delivery`).
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar
from urllib.parse import unquote, urlsplit

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, Status, StatusCode

from orchestrator.errors import GuardRejected, IllegalTransition, LifecycleError
from orchestrator.telemetry import semconv
from orchestrator.telemetry.delivery import Counted, Delivery, quiet_sdk_export_logs
from orchestrator.telemetry.listeners import AttributeValue, Listener, TransitionRecord

EXPORTERS = ("otlp", "console", "none")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def _otlp_protocol(env: Mapping[str, str]) -> str:
    return env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"


def exporter_problems(env: Mapping[str, str] | None = None) -> list[str]:
    """What in the `OTEL_*` variables colocate cannot export to (empty: nothing), one line each,
    so that a run refuses them before it starts."""
    env = os.environ if env is None else env
    requested = exporters_requested(env)
    problems = [
        f"OTEL_TRACES_EXPORTER={name!r}: colocate exports to {', '.join(EXPORTERS)}"
        for name in requested
        if name not in EXPORTERS
    ]
    if "otlp" in requested and (protocol := _otlp_protocol(env)) not in OTLP_PROTOCOLS:
        key = next(k for k in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") if env.get(k))
        problems.append(f"{key}={protocol!r}: colocate speaks OTLP over {' and '.join(OTLP_PROTOCOLS)}")
    if "otlp" in requested:
        problems += [f"{key}={env[key]!r}: {bad}" for key in ENDPOINTS if (bad := _endpoint_problem(env.get(key)))]
    return problems


def _endpoint_problem(endpoint: str | None) -> str | None:
    """Why an OTLP endpoint is not one (None: it is, or none is given). OpenTelemetry's spec asks
    for a URL with a scheme; without one the HTTP exporter finds no way to send (`localhost:4318`)."""
    if endpoint is None:
        return None
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"not a URL with http:// or https:// and a host (say http://{endpoint.split('://')[-1] or 'localhost:4318'})"
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        return f"{exc}"
    return None


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    if _otlp_protocol(env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _recode_ids(request: dict[str, Any], recode: Callable[[str], str]) -> dict[str, Any]:
    """OTLP/JSON writes ids as hex where the generic protobuf mapping writes base64."""
    for resource in request.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for item in (span, *span.get("links", [])):
                    for key in _ID_FIELDS:
                        if isinstance(item.get(key), str):
                            item[key] = recode(item[key])
    return request


def parse_otlp_json(line: str | dict[str, Any]) -> Any:
    """One OTLP/JSON line (or its decoded object) → `ExportTraceServiceRequest`, through the
    official protobuf mapping once the hex ids are turned back into the mapping's base64."""
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    data = json.loads(line) if isinstance(line, str) else line
    request = _recode_ids(data, lambda v: base64.b64encode(bytes.fromhex(v)).decode())
    return ParseDict(request, ExportTraceServiceRequest())


class OtlpJsonFileExporter(SpanExporter):
    """Appends each batch as one line of OTLP/JSON: `ExportTraceServiceRequest` in the protobuf
    JSON mapping, with OTLP's two deviations (hex ids, integer enums). It is what the OpenTelemetry
    Collector's file exporter writes and its otlpjsonfile receiver reads, and what Jaeger's UI loads."""

    def __init__(self, path: Path) -> None:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        self.path, self._encode, self._to_dict = path, encode_spans, MessageToDict
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        request = self._to_dict(self._encode(spans), use_integers_for_enums=True)
        _recode_ids(request, lambda v: base64.b64decode(v).hex())
        with self.path.open("a") as out:
            out.write(json.dumps(request, separators=(",", ":")) + "\n")
        return SpanExportResult.SUCCESS


def carrier() -> dict[str, str]:
    """The current trace context as W3C `traceparent` headers, to send with a remote call."""
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


P = ParamSpec("P")
R = TypeVar("R")


def carried(call: Callable[P, R]) -> Callable[P, R]:
    """`call`, to run in another thread (a pool's, a `threading.Thread`'s) under the context current
    here, where it is handed over: a thread starts with an empty context, so the spans it opens
    would be roots of traces of their own. The context is attached in that thread for the call
    and detached after it; nothing global changes."""
    captured = context.get_current()

    @functools.wraps(call)
    def in_context(*args: P.args, **kwargs: P.kwargs) -> R:
        token = context.attach(captured)
        try:
            return call(*args, **kwargs)
        finally:
            context.detach(token)

    return in_context


_RANK = context.create_key(semconv.RANK)  # the trainer rank a process-side call works for


@contextmanager
def continued(headers: Mapping[str, str], *, rank: int | None = None) -> Iterator[None]:
    """Make the caller's trace context (from `carrier()`) current for a call in another process;
    with `rank`, every `process_span` within the call says which trainer rank it works for."""
    ctx = propagate.extract(headers)
    if rank is not None:
        ctx = context.set_value(_RANK, rank, ctx)
    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


def rss_bytes() -> int | None:
    """This process's resident set size, or None where psutil is not installed."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


@contextmanager
def process_span(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Iterator[Span]:
    """A span of work in a rank or engine process, with the fixed keys of every process-side span:
    `colocate.rank` (where the call came from a rank, `continued(..., rank=)`) and the host memory
    before and after (RSS). Memory is read only when the span records."""
    with trace.get_tracer(semconv.TRACER).start_as_current_span(name, attributes=attributes) as span:
        recording = span.is_recording()
        if recording:
            rank = context.get_value(_RANK)
            if isinstance(rank, int):
                span.set_attribute(semconv.RANK, rank)
            _set_memory(span, semconv.MEMORY_BEFORE)
        try:
            yield span
        finally:
            if recording:
                _set_memory(span, semconv.MEMORY_AFTER)


def _set_memory(span: Span, key: str) -> None:
    rss = rss_bytes()
    if rss is not None:
        span.set_attribute(key, rss)


def exporters_requested(env: Mapping[str, str] | None = None) -> list[str]:
    """The exporters the `OTEL_*` variables ask for (empty: none)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return []
    wants_otlp = any(k in env for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "otlp" if wants_otlp else "none").split(",")]
    return [name for name in names if name not in ("none", "")]


def _env_resource(env: Mapping[str, str]) -> dict[str, str]:
    """`OTEL_RESOURCE_ATTRIBUTES`: comma-separated `key=value` pairs, values percent-encoded."""
    pairs = (item.split("=", 1) for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",") if "=" in item)
    return {key.strip(): unquote(value.strip()) for key, value in pairs}


def configure_tracing(
    service_name: str = "colocate",
    rank: int | None = 0,
    env: Mapping[str, str] | None = None,
    trace_file: Path | None = None,
    role: str = semconv.ROLE_DRIVER,
    delivery: Delivery | None = None,
) -> TracerProvider | None:
    """A tracer provider exporting where `OTEL_*` says, or None if tracing is not asked for.

    Honoured: OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER (otlp, console, none), the
    OTEL_EXPORTER_OTLP_* endpoint/protocol/header variables, and the resource's. The service's
    name is OpenTelemetry's order: OTEL_SERVICE_NAME, then `service.name` in
    OTEL_RESOURCE_ATTRIBUTES, then `service_name`; `colocate.role` and `colocate.rank` are
    colocate's to set. `trace_file` adds an OTLP-JSON file exporter. What `exporter_problems`
    names raises ValueError. The OTLP exporter counts into `delivery` (a new one, warning through
    this module's logger, if None): see the module's docstring.
    """
    env = os.environ if env is None else env
    if problems := exporter_problems(env):
        raise ValueError("; ".join(problems))
    exporters: list[SpanExporter] = []
    for name in exporters_requested(env):
        if name == "otlp":
            quiet_sdk_export_logs()
            exporters.append(Counted(_otlp_exporter(env), delivery or Delivery()))
        else:
            exporters.append(ConsoleSpanExporter())
    if trace_file is not None:
        exporters.append(OtlpJsonFileExporter(trace_file))
    if not exporters:
        return None
    attributes: dict[str, str | int] = {
        "service.name": service_name,
        **_env_resource(env),
        semconv.ROLE: role,
    }
    if env.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = env["OTEL_SERVICE_NAME"]
    if rank is not None:  # the engine's process serves every rank: it has none of its own
        attributes[semconv.RANK] = rank
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # export never blocks a transition
    return provider


class TracingListener(Listener):
    """Spans `colocate.step` and `lifecycle.<event>` with fixed `colocate.*` attributes.

    A transition's span opens when its event is fired, so the table's and the guards' judgement
    (with the engine queries of the snapshot they judge) lies inside it, and it is current for
    every listener that reports the outcome: a refusal's log line carries the refusal's span id.
    It names a destination only once the event entered it. Each span belongs to the record (or
    step) it traces, so a hook that arrives without its opening one still gets a span of its own,
    and no other span is ended early; one opened in a thread without a current span (a fault
    from a watchdog) is still a child of its step.
    """

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._provider = provider or trace.get_tracer_provider()
        self._tracer = self._provider.get_tracer(semconv.LIFECYCLE_SCOPE)
        self._steps: dict[int, tuple[Span, object]] = {}  # step → (span, context token)
        self._spans: dict[int, tuple[Span, object]] = {}  # id(record) → (span, context token)

    def _open(self, span: Span) -> tuple[Span, object]:
        return span, context.attach(trace.set_span_in_context(span))

    @staticmethod
    def _close(opened: tuple[Span, object]) -> Span:
        span, token = opened
        context.detach(token)  # type: ignore[arg-type]
        return span

    def _start(self, record: TransitionRecord) -> Span:
        parent = None
        if not trace.get_current_span().get_span_context().is_valid and record.step in self._steps:
            parent = trace.set_span_in_context(self._steps[record.step][0])
        return self._tracer.start_span(semconv.lifecycle_span(record.event), parent, attributes=_attributes(record))

    def _span_of(self, record: TransitionRecord) -> Span:
        """The span `on_begin` opened for `record`, or a new one if it never began."""
        opened = self._spans.pop(id(record), None)
        return self._start(record) if opened is None else self._close(opened)

    def on_step_start(self, step: int, rank: int) -> None:
        span = self._tracer.start_span(semconv.STEP_SPAN, attributes={semconv.STEP: step, semconv.RANK: rank})
        self._steps[step] = self._open(span)

    def on_step_end(self, step: int, rank: int, error: BaseException | None) -> None:
        opened = self._steps.pop(step, None)
        if opened is None:
            return
        span = self._close(opened)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

    def on_begin(self, record: TransitionRecord) -> None:
        self._spans[id(record)] = self._open(self._start(record))

    def on_transition(self, record: TransitionRecord) -> None:
        span = self._span_of(record)
        span.set_attribute(semconv.DESTINATION, record.dst.value)
        span.set_attributes(record.attributes)
        if record.cause is not None:  # the fault transition: its span carries the cause
            span.record_exception(record.cause)
            span.set_status(Status(StatusCode.ERROR, f"{type(record.cause).__name__}: {record.cause}"))
        span.end()

    def on_rejected(self, record: TransitionRecord, error: LifecycleError) -> None:
        span = self._span_of(record)
        span.set_attributes(record.attributes)
        if isinstance(error, GuardRejected):
            for verdict in error.verdicts:
                span.add_event(
                    semconv.GUARD_REJECTED_EVENT, {semconv.GUARD: verdict.guard, semconv.REASON: verdict.reason}
                )
        elif isinstance(error, IllegalTransition):
            legal = tuple(event.value for event in error.legal)
            span.add_event(semconv.TABLE_REJECTED_EVENT, {semconv.REASON: str(error), semconv.LEGAL_EVENTS: legal})
        span.set_attribute(semconv.REFUSED, True)
        span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()

    def on_fault(self, record: TransitionRecord, error: LifecycleError) -> None:
        span = self._span_of(record)
        span.set_attributes(record.attributes)
        # The cause, with its own type and traceback (`raise ... from` has not linked it yet).
        span.record_exception(record.cause if record.cause is not None else error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()
        flush = getattr(self._provider, "force_flush", None)  # the SDK's; the API's no-op has none
        if flush is not None:
            flush()  # a faulted run may not live to its next batch


def _attributes(record: TransitionRecord) -> dict[str, str | int]:
    """The fixed keys of a lifecycle span, known when its event is fired (its destination is
    not: it is set once reached)."""
    return {
        semconv.EVENT: record.event.value,
        semconv.SOURCE: record.src.value,
        semconv.STEP: record.step,
        semconv.RANK: record.rank,
        semconv.MODE: record.mode.value,
    }
