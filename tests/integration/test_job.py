"""The job in process (--ranks 1): the engine's weights compared with the trainer's each sync, a
failure between transitions, the rendezvous port, and the spans of every process-side call."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from orchestrator.errors import RankFailed
from orchestrator.job.config import Engine
from orchestrator.job.job import ColocatedJob, RunConfig, rendezvous_store
from orchestrator.telemetry.listeners import Listener, TransitionRecord
from orchestrator.telemetry.tracing import TracingListener
from states import Event, Phase, Region

pytestmark = pytest.mark.slow


class CorruptAfterSync(Listener):
    """Flips one bit of one engine weight right after the sync of step `step`."""

    def __init__(self, job: list[ColocatedJob], step: int) -> None:
        self.job, self.step = job, step

    def on_transition(self, record: TransitionRecord) -> None:
        if record.event is Event.UPDATE_WEIGHTS and record.step == self.step:
            weight = (
                self.job[0].engine.replicas.workers[0].engine.model.get_parameter("model.layers.0.mlp.down_proj.weight")
            )
            weight.data.view(torch.int16).view(-1)[3] ^= 1


def test_a_corrupted_engine_weight_is_reported_as_a_mismatch() -> None:
    holder: list[ColocatedJob] = []
    with ColocatedJob(RunConfig(steps=2, ranks=1), listeners=[CorruptAfterSync(holder, step=2)]) as job:
        holder.append(job)
        first, second = job.run_step(), job.run_step()
    assert first.engine_matches_trainer is True
    assert second.engine_matches_trainer is False
    assert job.report.engine_matches_trainer is False


def test_a_failure_between_transitions_leaves_the_lifecycle_faulted_with_its_cause() -> None:
    """The engine fails while the driver compares digests, after update_weights and before
    drop_params: no transition is running, and the step still ends in FAULTED."""
    gone = ConnectionError("the engine went away")

    def digests() -> dict[str, str]:
        raise gone

    with ColocatedJob(RunConfig(steps=1, ranks=1)) as job:
        job.engine.replicas.workers[0].engine.digests = digests  # the in-process engine's own method
        with pytest.raises(RankFailed, match="engine failed in digests: ConnectionError"):
            job.run_step()
    assert job.lifecycle.phase is Phase.FAULTED
    assert isinstance(job.lifecycle.fault_cause, RankFailed) and job.lifecycle.fault_cause.cause is gone
    assert job.report.steps[-1].phases[-2:] == ["WEIGHTS_SYNCED", "FAULTED"]


def test_a_cpu_run_leaves_the_drivers_environment_as_it_was() -> None:
    """The rank and the engine in this process take the CPU because they are told to, not because
    the driver hid its GPUs from itself: colocate changes nothing of `os.environ`. The one write
    is Megatron-core's own: building a GPT model sets Transformer Engine's attention-backend flags
    (`LanguageModule._set_attention_backend`), the same values at every build."""
    megatrons = {"NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"}

    def environment() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k not in megatrons}

    before = environment()
    job = ColocatedJob(RunConfig(steps=1, ranks=1))
    assert not torch.distributed.is_initialized(), "a job starts nothing before `with` (or start())"
    with job:
        assert torch.distributed.is_initialized()
        job.run_step()
        assert environment() == before
    assert environment() == before
    assert {p.device.type for p in job.engine.replicas.workers[0].engine.model.parameters()} == {"cpu"}


class Abort(BaseException):
    """Neither an error nor Ctrl-C."""


def test_leaving_the_with_block_by_any_exception_stops_the_job() -> None:
    with pytest.raises(Abort), ColocatedJob(RunConfig(steps=1, ranks=1)) as job:
        assert job.phase == Phase.TRAIN and torch.distributed.is_initialized()
        raise Abort
    assert not torch.distributed.is_initialized(), "the in-process rank left its process group"
    with pytest.raises(RuntimeError, match="the job has not started"):
        _ = ColocatedJob(RunConfig(steps=1, ranks=1)).lifecycle


def test_the_rendezvous_port_is_held_before_any_rank_hears_of_it() -> None:
    store = rendezvous_store()
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", store.port))
    assert taken.value.errno == errno.EADDRINUSE


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """An SDK provider with the in-memory exporter as the global one, for this test only (the
    process-side spans use the global provider, as in a rank's own process)."""
    from opentelemetry.util._once import Once

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    saved = trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace.set_tracer_provider(provider)
    yield exporter
    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = saved


def _began(span: Any) -> int:
    return int(span.start_time or 0)


def test_every_process_side_span_has_its_rank_memory_and_a_parent(spans: InMemorySpanExporter) -> None:
    with ColocatedJob(RunConfig(steps=1, ranks=1), listeners=[TracingListener(trace.get_tracer_provider())]) as job:
        job.run_step()
    found = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in found}
    names = {s.name for s in found}
    assert {"rank.bucket", "rank.cast", "rank.extras", "rank.digest", "rank.push_weights"} <= names
    for span in found:
        if span.name.startswith(("rank.", "engine.")):
            assert isinstance(span.attributes.get("colocate.memory_before"), int), span.name
            assert isinstance(span.attributes.get("colocate.memory_after"), int), span.name
            expected_rank = 0 if span.name.startswith("rank.") else None
            assert span.attributes.get("colocate.rank") == expected_rank, span.name
    assert {s.name for s in found if s.parent is None} == {"colocate.start", "colocate.step", "colocate.close"}
    regions = {s.name: set() for s in found if s.name in ("rank.pause", "rank.resume")}
    for span in found:
        if span.name in regions:
            regions[span.name].add(span.attributes.get("colocate.region"))
    assert regions == {"rank.pause": {r.value for r in Region}, "rank.resume": {r.value for r in Region}}, regions
    start = next(s for s in found if s.name == "colocate.start")
    parts = sorted((s for s in found if s.parent and s.parent.span_id == start.context.span_id), key=_began)
    assert [s.name for s in parts] == [
        "start.connect",
        "start.cluster",
        "start.ranks",
        "start.engine",
        "start.lifecycle",
    ]
    # The start-up's children are its parts alone (the names above), so whatever else it traces
    # lies inside one; and they run one after another within it (one clock): each begins once
    # the one before has ended, the first after `colocate.start` began, the last before it ended.
    bounds = [start.start_time, *(t for s in parts for t in (s.start_time, s.end_time)), start.end_time]
    assert bounds == sorted(bounds), [(s.name, s.start_time, s.end_time) for s in (start, *parts)]
    release = next(s for s in found if s.name == "engine.release")
    assert release.parent is not None and by_id[release.parent.span_id].name == "start.lifecycle"
    for name in ("engine.digests", "rank.converted_digests"):
        (span,) = [s for s in found if s.name == name]
        parent = by_id[span.parent.span_id]
        assert parent.name == "colocate.engine_matches_trainer", name
        assert by_id[parent.parent.span_id].name == "colocate.step"


def test_with_an_engine_that_cannot_report_its_weights_no_check_span_is_left_without_a_value(
    spans: InMemorySpanExporter,
) -> None:
    """SGLang (the stand-in here, serving a transformers model in this process) cannot report its
    weights: the step has no `colocate.engine_matches_trainer` span, where one would have no value."""
    from orchestrator.adapters.engines.transformers import TransformersEngine
    from orchestrator.core.config import EngineKind
    from orchestrator.job.grpo import GRPOConfig
    from tests.support.sglang_server import SGLangStandIn

    grpo = GRPOConfig()
    model = TransformersEngine(grpo.model, max_batch=grpo.prompts_per_step * grpo.group_size)
    with SGLangStandIn(model=model) as server:
        config = RunConfig(engine=Engine(kind=EngineKind.SGLANG, urls=(server.url,)), ranks=1, steps=1, grpo=grpo)
        listeners = [TracingListener(trace.get_tracer_provider())]
        with ColocatedJob(config, listeners=listeners) as job:
            outcome = job.run_step()
    assert outcome.engine_matches_trainer is None
    found = spans.get_finished_spans()
    assert any(s.name == "POST /update_weights_from_tensor" for s in found)
    assert not [s for s in found if s.name == "colocate.engine_matches_trainer"]
