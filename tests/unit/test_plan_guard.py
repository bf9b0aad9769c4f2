"""The memory-budget guard: each row that brings memory back, refusals with bytes, the trace."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from guards.memory import device_free, memory_fits
from orchestrator.errors import ConfigError, GuardRejected
from orchestrator.plan.budget import MemoryProbe
from orchestrator.plan.memory import EngineSpec, Parallelism, plan
from orchestrator.plan.presets import load_model
from orchestrator.telemetry.tracing import TracingListener
from states import EngineMemory, MemoryBudget, Mode, Phase, Region
from tests.support.rig import make_rig
from tests.support.snapshots import snap

REGIONS = {Region.PARAM_BUFFER: 200, Region.GRAD_BUFFER: 400, Region.DEFAULT: 1200}
ENGINE = {EngineMemory.WEIGHTS: 300, EngineMemory.KV_CACHE: 1000, EngineMemory.CUDA_GRAPH: 50}


def budget(free: int) -> MemoryBudget:
    return MemoryBudget(device_free=free, regions=REGIONS, engine=ENGINE, source="cuda:0")


@pytest.mark.parametrize(
    ("phase", "paused", "resident", "need"),
    [
        # update_weights: the engine's weights come back beside the trainer's params
        (Phase.GRADS_PAUSED, {Region.GRAD_BUFFER, Region.DEFAULT}, set(), 300),
        # rollout: KV cache + CUDA graphs come back
        (Phase.PARAMS_DROPPED, set(Region), {EngineMemory.WEIGHTS}, 1050),
        # restore: the regions come back once the engine has released weights + KV + graphs
        (Phase.ROLLOUT, set(Region), set(EngineMemory), 1800 - 1350),
    ],
)
def test_each_row_refuses_one_byte_short_and_admits_at_the_need(phase, paused, resident, need) -> None:
    base = snap(phase=phase, paused=frozenset(paused), engine_resident=frozenset(resident))
    assert memory_fits(replace(base, memory=budget(need))).ok
    refused = memory_fits(replace(base, memory=budget(need - 1)))
    assert not refused.ok
    assert f"needs {need:,} bytes" in refused.reason and f"{need - 1:,} bytes" in refused.reason
    assert "cuda:0" in refused.reason


def test_no_plan_or_a_phase_that_adds_nothing_is_admitted() -> None:
    assert memory_fits(snap(memory=None)).ok
    assert memory_fits(snap(phase=Phase.TRAIN, memory=budget(0))).ok


def test_an_explicit_limit_counts_what_the_plan_says_is_resident() -> None:
    limited = MemoryBudget(device_limit=2000, regions=REGIONS, engine=ENGINE)
    # GRADS_PAUSED: the param buffer (200) is resident, so 1800 of 2000 are free
    assert device_free(snap(memory=limited), limited) == 1800
    assert memory_fits(snap(memory=limited)).ok
    tight = replace(limited, device_limit=499)  # 200 resident + 300 of weights needs 500
    verdict = memory_fits(snap(memory=tight))
    assert not verdict.ok and "needs 300 bytes" in verdict.reason and "299 bytes" in verdict.reason


def _probe_for(limit: int) -> MemoryProbe:
    the_plan = plan(load_model("qwen3-4b"), Parallelism(tp=2, dp=2), engine=EngineSpec(mem_fraction_static=0.5))
    return MemoryProbe.for_plan(the_plan, limit=limit, host_free=10**12)


def test_the_lifecycle_refuses_a_rollout_that_would_not_fit_and_the_trace_says_why() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    probe = _probe_for(limit=40 * 10**9)  # KV pool of the plan is about 70 GB: it cannot fit
    rig = make_rig(listeners=(TracingListener(provider),), memory=probe)
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()  # engine weights (about 4 GB) fit
    lc.drop_params()
    calls, resident = list(rig.engine.calls), set(rig.engine.resident)
    with pytest.raises(GuardRejected) as caught:
        lc.rollout()
    assert lc.phase is Phase.PARAMS_DROPPED  # nothing moved
    assert rig.engine.calls == calls and rig.engine.resident == resident  # the KV never came back
    (verdict,) = caught.value.verdicts
    kv = probe.engine[EngineMemory.KV_CACHE]
    assert verdict.guard == "memory_fits" and f"needs {kv:,} bytes" in verdict.reason
    span = exporter.get_finished_spans()[-1]
    assert span.name == "lifecycle.rollout" and span.status.status_code is StatusCode.ERROR
    reasons = [e.attributes for e in span.events if e.name == "guard.rejected"]
    assert reasons == [{"colocate.guard": "memory_fits", "colocate.reason": verdict.reason}]
    assert "GB budget" in verdict.reason


def test_a_budget_that_fits_runs_the_whole_cycle() -> None:
    rig = make_rig(memory=_probe_for(limit=141 * 10**9))
    lc = rig.lifecycle
    for step in (lc.pause_grads, lc.update_weights, lc.drop_params, lc.rollout, lc.restore):
        step()
    assert lc.phase is Phase.TRAIN


def test_the_host_must_hold_the_pinned_backup_at_init() -> None:
    the_plan = plan(load_model("qwen3-4b"), Parallelism(tp=2, dp=2), mode=Mode.BACKUP)
    pinned = the_plan.ranks[0].backup
    MemoryProbe.for_plan(the_plan, limit=10**11, host_free=pinned)
    with pytest.raises(ConfigError) as caught:
        MemoryProbe.for_plan(the_plan, limit=10**11, host_free=pinned - 1)
    assert f"needs {pinned:,} bytes" in str(caught.value) and f"{pinned - 1:,} bytes" in str(caught.value)


def test_a_probe_reads_free_memory_or_takes_a_limit_not_both() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        MemoryProbe(regions={}, engine={})
