"""Fault and refusal spans, read back through the OTel SDK's in-memory exporter (issue 12 item 9)."""

from __future__ import annotations

import threading
import time

import pytest
import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from orchestrator import ActionFailed, GuardRejected, IllegalTransition
from orchestrator.telemetry.logs import LoggingListener
from orchestrator.telemetry.tracing import TracingListener
from tests.support.rig import Rig, make_rig


@pytest.fixture
def traced() -> tuple[Rig, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return make_rig(listeners=(TracingListener(provider), LoggingListener())), exporter


def _exception_events(span: ReadableSpan) -> list[dict]:
    return [dict(e.attributes or {}) for e in span.events if e.name == "exception"]


def test_a_failed_action_span_records_the_cause_with_its_traceback(traced: tuple[Rig, InMemorySpanExporter]) -> None:
    rig, exporter = traced
    rig.transport.fail = True
    rig.lifecycle.pause_grads()
    with pytest.raises(ActionFailed):
        rig.lifecycle.update_weights()
    failed, fault = exporter.get_finished_spans()[-2:]
    assert (failed.name, fault.name) == ("lifecycle.update_weights", "lifecycle.fault")
    (event,) = _exception_events(failed)
    assert event["exception.type"] == "RuntimeError"
    assert "update_weights_from_tensor returned success=false" in event["exception.message"]
    assert "in push" in event["exception.stacktrace"], "the traceback of the cause, where it was raised"


def test_the_fault_span_is_an_error_carrying_the_cause(traced: tuple[Rig, InMemorySpanExporter]) -> None:
    rig, exporter = traced
    rig.lifecycle.fault("rank 1 died")
    (span,) = exporter.get_finished_spans()
    assert span.name == "lifecycle.fault" and span.status.status_code is StatusCode.ERROR
    assert "rank 1 died" in (span.status.description or "")
    (event,) = _exception_events(span)
    assert event["exception.message"] == "rank 1 died"


def test_a_refused_span_names_no_destination(traced: tuple[Rig, InMemorySpanExporter]) -> None:
    rig, exporter = traced
    rig.lifecycle.pause_grads()
    with pytest.raises(GuardRejected):
        rig.lifecycle.skip_update()
    span = exporter.get_finished_spans()[-1]
    assert span.name == "lifecycle.skip_update" and span.attributes is not None
    assert "colocate.destination" not in span.attributes
    assert span.attributes["colocate.source"] == "GRADS_PAUSED"


def test_a_snapshot_that_fails_during_admission_leaves_the_step_span_whole(
    traced: tuple[Rig, InMemorySpanExporter],
) -> None:
    """The engine dies while update_weights is admitted: its span and the fault's close, and the
    step span still ends as the step's parent, with the step's error."""
    rig, exporter = traced

    def dead() -> bool:
        raise ConnectionError("engine actor died")

    with pytest.raises(ActionFailed), rig.lifecycle.step():
        rig.lifecycle.pause_grads()
        rig.engine.is_idle = dead  # type: ignore[method-assign]
        rig.lifecycle.update_weights()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [
        "lifecycle.pause_grads",
        "lifecycle.update_weights",
        "lifecycle.fault",
        "colocate.step",
    ]
    step = spans[-1]
    assert all(s.parent is not None and s.parent.span_id == step.context.span_id for s in spans[:-1])
    assert step.status.status_code is StatusCode.ERROR
    assert rig.lifecycle.phase.value == "FAULTED"


# ---- each line and span says what happened, and nothing it did not reach (issue 26 items 2, 3, 5, 9) ----


def _ids(span: ReadableSpan) -> tuple[str, str]:
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


def test_a_refused_events_log_line_carries_the_refusals_own_span(traced: tuple[Rig, InMemorySpanExporter]) -> None:
    rig, exporter = traced
    with structlog.testing.capture_logs() as logs, rig.lifecycle.step():
        rig.lifecycle.pause_grads()
        with pytest.raises(GuardRejected):
            rig.lifecycle.skip_update()
    refused = next(s for s in exporter.get_finished_spans() if s.name == "lifecycle.skip_update")
    line = next(line for line in logs if line["event"] == "skip_update")
    assert (line["trace_id"], line["span_id"]) == _ids(refused)
    assert line["dst"] is None, "a refused event entered no phase"


def test_a_failed_action_claims_no_destination_and_the_fault_does(traced: tuple[Rig, InMemorySpanExporter]) -> None:
    """update_weights fails: its span and line name no destination, and carry their own ids; the
    `fault` transition that follows is the one that entered FAULTED."""
    rig, exporter = traced
    rig.transport.fail = True
    with structlog.testing.capture_logs() as logs, pytest.raises(ActionFailed), rig.lifecycle.step():
        rig.lifecycle.pause_grads()
        rig.lifecycle.update_weights()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    failed, fault = spans["lifecycle.update_weights"], spans["lifecycle.fault"]
    assert "colocate.destination" not in (failed.attributes or {})
    assert failed.status.status_code is StatusCode.ERROR
    assert (fault.attributes or {})["colocate.destination"] == "FAULTED"
    lines = {line["event"]: line for line in logs}
    assert lines["update_weights"]["dst"] is None and lines["fault"]["dst"] == "FAULTED"
    assert (lines["update_weights"]["trace_id"], lines["update_weights"]["span_id"]) == _ids(failed)
    assert (lines["fault"]["trace_id"], lines["fault"]["span_id"]) == _ids(fault)


def test_a_fault_from_another_thread_is_a_child_of_the_step_with_its_own_ids(
    traced: tuple[Rig, InMemorySpanExporter],
) -> None:
    """A watchdog's thread has no current span: the fault it lands is still its step's child."""
    rig, exporter = traced
    with structlog.testing.capture_logs() as logs, rig.lifecycle.step():
        rig.lifecycle.pause_grads()
        watchdog = threading.Thread(target=rig.lifecycle.fault, args=("rank 1 died",))
        watchdog.start()
        watchdog.join()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    fault, step = spans["lifecycle.fault"], spans["colocate.step"]
    assert fault.parent is not None and fault.parent.span_id == step.context.span_id
    line = next(line for line in logs if line["event"] == "fault")
    assert (line["trace_id"], line["span_id"]) == _ids(fault)


def test_the_guards_judgement_lies_inside_the_transitions_span(traced: tuple[Rig, InMemorySpanExporter]) -> None:
    """The snapshot the guards judge asks the engine whether it is idle: 50 ms here. The span and
    the log line time the same thing, and a span the query makes is the transition's child."""
    rig, exporter = traced
    tracer = rig.lifecycle.listeners.listeners[0]._tracer  # type: ignore[attr-defined]
    idle = rig.engine.is_idle

    def slow_idle() -> bool:
        with tracer.start_as_current_span("engine.is_idle"):
            time.sleep(0.05)
            return idle()

    rig.engine.is_idle = slow_idle  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        rig.lifecycle.pause_grads()
        called = time.time_ns(), time.perf_counter_ns()
        rig.lifecycle.update_weights()
        returned = time.time_ns(), time.perf_counter_ns()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    update = spans["lifecycle.update_weights"]
    assert update.end_time is not None and update.start_time is not None
    seconds = next(line["seconds"] for line in logs if line["event"] == "update_weights")
    assert seconds >= 0.05
    queries = [s for s in exporter.get_finished_spans() if s.name == "engine.is_idle"]
    assert queries and all(q.parent is not None for q in queries)
    assert update.context.span_id in {q.parent.span_id for q in queries if q.parent is not None}
    # Both time the call and the judgement in it: the span lies inside the call and holds the
    # queries it parents (one clock, time_ns), and the logged seconds (perf_counter_ns, which
    # ticks alike) are at least those queries' and at most the call's, to the log's microsecond.
    judged = [q for q in queries if q.parent is not None and q.parent.span_id == update.context.span_id]
    assert called[0] <= update.start_time and update.end_time <= returned[0]
    assert all(update.start_time <= (q.start_time or 0) and (q.end_time or 0) <= update.end_time for q in judged)
    queried = sum((q.end_time or 0) - (q.start_time or 0) for q in judged) / 1e9
    assert queried - 1e-6 <= seconds <= (returned[1] - called[1]) / 1e9 + 1e-6


def test_an_illegal_event_says_why_in_a_span_event(traced: tuple[Rig, InMemorySpanExporter]) -> None:
    rig, exporter = traced
    with pytest.raises(IllegalTransition):
        rig.lifecycle.restore()
    (span,) = exporter.get_finished_spans()
    (event,) = [e for e in span.events if e.name == "table.rejected"]
    attributes = dict(event.attributes or {})
    assert "restore is not legal in TRAIN" in str(attributes["colocate.reason"])
    assert tuple(attributes["colocate.legal_events"]) == tuple(e.value for e in rig.lifecycle.legal_events())
    assert (span.attributes or {})["colocate.refused"] is True
