"""`ColocatedJob.close` in a trace of its own, `colocate.close`: what the close asks of the engine and
the processes are its children, whatever span is current when it runs, and a second close has none."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator.job.config import RunConfig
from orchestrator.job.job import ColocatedJob


def test_the_close_is_one_root_trace_with_what_it_asks_as_children(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", provider.get_tracer)  # the job's spans, to this provider only
    tracer = provider.get_tracer("test")
    job = ColocatedJob(RunConfig())
    job.close()  # never started: nothing to close, no trace
    assert exporter.get_finished_spans() == ()
    job._closable = True  # as `start` leaves it, with what it acquired on the stack:
    job._started.callback(lambda: tracer.start_span("POST /resume_memory_occupation").end())
    with tracer.start_as_current_span("colocate.step"):  # a step's span a failure left current
        job.close()
        job.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["POST /resume_memory_occupation", "colocate.close", "colocate.step"]
    close, post = spans["colocate.close"], spans["POST /resume_memory_occupation"]
    assert close.parent is None and close.context.trace_id != spans["colocate.step"].context.trace_id
    assert post.parent is not None and post.parent.span_id == close.context.span_id
