"""Fault and refusal spans, read back through the OTel SDK's in-memory exporter (issue 12 item 9)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from orchestrator import ActionFailed, GuardRejected
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
