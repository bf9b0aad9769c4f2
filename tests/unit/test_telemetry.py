"""Spans and log lines, read back through the OTel SDK's in-memory exporter and structlog."""

from __future__ import annotations

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from orchestrator import ActionFailed, GuardRejected, Listener, TransitionRecord
from orchestrator.telemetry.logs import LoggingListener
from orchestrator.telemetry.tracing import TracingListener, configure_tracing
from tests.support.rig import cycle, make_rig

STEP = ["pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _listeners(exporter: InMemorySpanExporter) -> tuple[Listener, ...]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return (TracingListener(provider), LoggingListener())


def test_each_transition_is_one_span_under_the_step_span(exporter: InMemorySpanExporter) -> None:
    rig = make_rig(listeners=_listeners(exporter))
    with rig.lifecycle.step():
        cycle(rig)
    spans = exporter.get_finished_spans()
    step = next(s for s in spans if s.name == "colocate.step")
    children = [s for s in spans if s.name.startswith("lifecycle.")]
    assert [s.name for s in children] == [f"lifecycle.{e}" for e in STEP]
    assert all(s.parent is not None and s.parent.span_id == step.context.span_id for s in children)
    assert all(s.context.trace_id == step.context.trace_id for s in children)
    update = children[1].attributes
    assert update["colocate.source"] == "GRADS_PAUSED" and update["colocate.destination"] == "WEIGHTS_SYNCED"
    assert update["colocate.step"] == 1 and update["colocate.rank"] == 0 and update["colocate.mode"] == "rematerialize"
    assert update["colocate.weight_version"] == 1 and update["colocate.bytes_moved"] > 0
    assert children[4].attributes["colocate.restore_verified"] is True


def test_refusal_span_is_error_with_verdicts(exporter: InMemorySpanExporter) -> None:
    rig = make_rig(listeners=_listeners(exporter))
    rig.lifecycle.pause_grads()
    with pytest.raises(GuardRejected):
        rig.lifecycle.skip_update()
    span = exporter.get_finished_spans()[-1]
    assert span.name == "lifecycle.skip_update" and span.status.status_code is StatusCode.ERROR
    guards = {e.attributes["colocate.guard"] for e in span.events if e.name == "guard.rejected"}
    assert guards == {"engine_synced"}


def test_fault_span_records_the_cause(exporter: InMemorySpanExporter) -> None:
    rig = make_rig(listeners=_listeners(exporter))
    rig.transport.fail = True
    rig.lifecycle.pause_grads()
    with pytest.raises(ActionFailed):
        rig.lifecycle.update_weights()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names[-2:] == ["lifecycle.update_weights", "lifecycle.fault"]
    failed = exporter.get_finished_spans()[-2]
    assert failed.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in failed.events)


def test_each_transition_is_one_log_line_with_fixed_keys(exporter: InMemorySpanExporter) -> None:
    rig = make_rig(listeners=_listeners(exporter))
    with structlog.testing.capture_logs() as logs, rig.lifecycle.step():
        cycle(rig)
    assert [line["event"] for line in logs] == STEP
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for line in logs:
        assert {"event", "src", "dst", "step", "rank", "mode", "trace_id", "span_id", "seconds"} <= line.keys()
        span = spans[f"lifecycle.{line['event']}"]
        assert line["trace_id"] == format(span.context.trace_id, "032x")
        assert line["span_id"] == format(span.context.span_id, "016x")
    assert logs[0]["src"] == "TRAIN" and logs[0]["dst"] == "GRADS_PAUSED" and logs[0]["step"] == 1


def test_refusal_logs_a_warning_with_reasons() -> None:
    rig = make_rig(listeners=(LoggingListener(),))
    with structlog.testing.capture_logs() as logs, pytest.raises(GuardRejected):
        rig.lifecycle.pause_grads()
        rig.lifecycle.skip_update()
    line = logs[-1]
    assert line["log_level"] == "warning" and line["event"] == "skip_update"
    assert any("engine_synced" in reason for reason in line["refused"])


class Broken(Listener):
    def on_begin(self, record: TransitionRecord) -> None:
        raise RuntimeError("sink down")

    def on_transition(self, record: TransitionRecord) -> None:
        raise RuntimeError("sink down")


def test_a_failing_listener_never_breaks_the_lifecycle(exporter: InMemorySpanExporter, caplog) -> None:
    rig = make_rig(listeners=(Broken(), *_listeners(exporter)))
    for _ in range(2):
        cycle(rig)
    assert rig.engine.version == 2
    assert len([s for s in exporter.get_finished_spans() if s.name.startswith("lifecycle.")]) == 12
    assert sum("listener Broken failed" in r.message for r in caplog.records) == 2, "reported once per hook"


def test_tracing_is_off_unless_configured() -> None:
    assert configure_tracing(env={}) is None
    assert configure_tracing(env={"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}) is None
    assert configure_tracing(env={"OTEL_TRACES_EXPORTER": "none"}) is None


@pytest.mark.parametrize(
    ("env", "service"),
    [
        ({}, "colocate"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "team=rl,service.name=from%20attributes"}, "from attributes"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "named"}, "named"),
    ],
)
def test_the_service_name_follows_opentelemetrys_order(env: dict[str, str], service: str) -> None:
    """OTEL_SERVICE_NAME, then `service.name` in OTEL_RESOURCE_ATTRIBUTES, then colocate's default;
    the role and rank are colocate's own, whatever the variables say."""
    provider = configure_tracing(
        rank=1,
        env={
            "OTEL_TRACES_EXPORTER": "console",
            **env,
            "OTEL_RESOURCE_ATTRIBUTES": env.get("OTEL_RESOURCE_ATTRIBUTES", "") + ",colocate.role=spoofed",
        },
        role="rank",
    )
    assert provider is not None
    attributes = provider.resource.attributes
    assert attributes["service.name"] == service
    assert attributes["colocate.role"] == "rank" and attributes["colocate.rank"] == 1
    if "team=rl" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert attributes["team"] == "rl"
    provider.shutdown()


def test_tracing_configured_from_otel_variables() -> None:
    provider = configure_tracing(
        rank=1, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SERVICE_NAME": "rl-job"}
    )
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "rl-job"
    assert provider.resource.attributes["colocate.rank"] == 1
    provider.shutdown()
    grpc = configure_tracing(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert grpc is not None
    grpc.shutdown()
    with pytest.raises(ValueError, match="zipkin"):
        configure_tracing(env={"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="http/json"):
        configure_tracing(env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_a_call_handed_to_another_thread_carries_the_span_it_was_handed_in(exporter: InMemorySpanExporter) -> None:
    """A pool's thread or a `threading.Thread` starts with an empty context: without `carried`, its
    spans would be roots of traces of their own. The context is the thread's for the call only."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from opentelemetry import trace

    from orchestrator.telemetry.tracing import carried

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    def work(name: str) -> bool:
        with tracer.start_as_current_span(name):
            return True

    def current_is_valid() -> bool:
        return trace.get_current_span().get_span_context().is_valid

    with ThreadPoolExecutor(1) as pool, tracer.start_as_current_span("parent") as parent:
        assert pool.submit(carried(work), "pooled").result()
        assert list(pool.map(carried(work), ["mapped"])) == [True]
        assert not pool.submit(current_is_valid).result()  # detached after each call: its thread is clean
        assert pool.submit(work, "uncarried").result()
        thread = threading.Thread(target=carried(work), args=("threaded",))
        thread.start()
        thread.join()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for name in ("pooled", "mapped", "threaded"):
        assert spans[name].parent is not None and spans[name].parent.span_id == parent.get_span_context().span_id
        assert spans[name].context.trace_id == parent.get_span_context().trace_id
    assert spans["uncarried"].parent is None  # what every POST of the per-TP-rank push was
