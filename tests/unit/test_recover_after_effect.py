"""Failures after an adapter call took effect (issue 24, repros A–E) and faults from other threads
(F, G), through the public API. Each test injects the failure, then asserts what recover leaves:
TRAIN with nothing paused, the engine holding nothing, the params cast(mains) bit for bit, and a
whole cycle that completes. The adapters are the in-memory ones unless a test names a real one
(StorageRegions on real CPU tensors, the transformers engine).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from orchestrator import ActionFailed, Lifecycle, LifecycleConfig, Listener, TransitionRecord
from orchestrator.adapters.regions.storage import StorageRegions
from orchestrator.errors import RecoveryRefused
from orchestrator.telemetry import semconv
from orchestrator.testing import InMemoryRegions, InMemoryTrainer, InMemoryTransport
from states import EngineMemory, Event, Mode, Phase, Region
from tests.support.inject import Timeout, after_effect
from tests.support.rig import Rig, cycle, make_rig, to_rollout

ALL = frozenset(EngineMemory)


def bf16_of_mains(trainer: InMemoryTrainer) -> dict[str, torch.Tensor]:
    return {name: main.to(torch.bfloat16) for name, main in trainer.mains.items()}


def assert_back_in_train(rig: Rig) -> None:
    """What recover promises, read from the adapters, then a whole cycle."""
    lc, trainer = rig.lifecycle, rig.trainer
    assert lc.phase is Phase.TRAIN and lc.fault_cause is None
    assert rig.regions.paused == frozenset() and rig.engine.released() == ALL
    for name, expected in bf16_of_mains(trainer).items():
        assert torch.equal(trainer.params[name], expected), f"{name} is not cast(mains) after recover"
    cycle(rig)
    assert lc.phase is Phase.TRAIN and rig.engine.version == lc.weight_version


# ---- A: a region resume takes effect, then raises ------------------------------------------------


class Transitions(Listener):
    def __init__(self) -> None:
        self.records: list[TransitionRecord] = []

    def on_transition(self, record: TransitionRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("tag", list(Region))
def test_a_resume_that_took_effect_is_not_repeated(tag: Region) -> None:
    seen = Transitions()
    rig = make_rig(listeners=(seen,))
    to_rollout(rig)
    after_effect(rig.regions, "resume", lambda t: t == tag)
    with pytest.raises(ActionFailed, match="Timeout"):
        rig.lifecycle.restore()
    rig.lifecycle.recover()
    assert rig.regions.calls.count(("resume", tag.value)) == 1, "the resume that took effect was repeated"
    (recovered,) = [r for r in seen.records if r.event is Event.RECOVER]
    found = recovered.attributes[semconv.RECONCILED]
    assert f"{tag.value} is paused" not in found, found  # resumed already: it took effect
    assert any(difference.startswith("the params are not known to be cast(mains)") for difference in found), found
    assert_back_in_train(rig)


def storage_rig() -> tuple[Rig, StorageRegions]:
    """The in-memory trainer's tensors under StorageRegions: pauses really free their storages."""
    trainer = InMemoryTrainer(mains={f"layer{i}.weight": torch.randn(256, 256) for i in range(2)})
    grads = [torch.zeros(256, 256)]
    regions = StorageRegions(
        lambda: {
            "param_buffer": list(trainer.params.values()),
            "grad_buffer": grads,
            "default": [*trainer.mains.values()],
        }
    )
    return make_rig(trainer=trainer, regions=regions), regions  # type: ignore[arg-type]


def test_a_storage_regions_resume_that_took_effect_is_not_repeated() -> None:
    rig, regions = storage_rig()
    to_rollout(rig)
    after_effect(regions, "resume", lambda t: t == Region.DEFAULT)
    with pytest.raises(ActionFailed, match="Timeout"):
        rig.lifecycle.restore()
    assert Region.DEFAULT.value not in regions.paused
    rig.lifecycle.recover()
    assert rig.lifecycle.phase is Phase.TRAIN and regions.paused == frozenset()
    for name, expected in bf16_of_mains(rig.trainer).items():
        assert torch.equal(rig.trainer.params[name], expected)
    cycle(rig)


# ---- B: a region pause takes effect, then raises -------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.REMATERIALIZE, Mode.BACKUP])
@pytest.mark.parametrize("tag", list(Region))
def test_b_a_pause_that_took_effect_is_resumed_and_the_params_rebuilt(mode: Mode, tag: Region) -> None:
    rig = make_rig(mode)
    cycle(rig)
    after_effect(rig.regions, "pause", lambda t: t == tag)
    lc = rig.lifecycle
    with pytest.raises(ActionFailed, match="Timeout"):
        lc.pause_grads()
        lc.update_weights()
        lc.drop_params()
    assert tag.value in rig.regions.paused
    lc.recover()
    assert_back_in_train(rig)


# ---- C: engine.release takes effect, then raises (the transformers engine) ------------------------


def hf_rig() -> Rig:
    """The in-memory trainer synced into the real transformers engine, names as it loads them."""
    from tests.support.contract_cases import hf_weights, tiny_hf_engine

    engine = tiny_hf_engine()
    mains = {name: t.float() for name, t in hf_weights(engine.model)}
    trainer = InMemoryTrainer(mains=mains, extra=torch.zeros(0))
    regions = InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop})
    transport = HFTransport(trainer, engine)
    lc = Lifecycle(config=LifecycleConfig(), trainer=trainer, regions=regions, engine=engine, transport=transport)
    return Rig(lc, trainer, engine, regions, transport)  # type: ignore[arg-type]


class HFTransport(InMemoryTransport):
    """Every param, under its own name, into `update_weights` (the extra has no engine name)."""

    def push(self, version: int) -> Any:
        from orchestrator.protocols import TransferReport

        named = list(self.trainer.params.items())
        written = self.engine.update_weights(named, version)  # type: ignore[attr-defined]
        return TransferReport(tensors=len(named), bytes=written, buckets=1)


def test_c_a_release_that_took_effect_is_not_repeated() -> None:
    rig = hf_rig()
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    lc.rollout()
    after_effect(rig.engine, "release")
    with pytest.raises(ActionFailed, match="Timeout"):
        lc.restore()
    assert rig.engine.released() == ALL
    lc.recover()
    assert lc.phase is Phase.TRAIN and rig.engine.released() == ALL
    lc.pause_grads()
    lc.update_weights()
    assert rig.engine.weight_version() == lc.weight_version


# ---- D: engine.resume takes effect, then raises ---------------------------------------------------


def test_d_kv_resumed_before_the_rollout_failed_is_released_by_recover() -> None:
    rig = make_rig()
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    after_effect(rig.engine, "resume", lambda tags: EngineMemory.KV_CACHE in tags)
    with pytest.raises(ActionFailed, match="Timeout"):
        lc.rollout()
    assert EngineMemory.KV_CACHE not in rig.engine.released()
    lc.recover()
    assert_back_in_train(rig)


def test_d_weights_resumed_before_the_update_failed_are_released_by_recover() -> None:
    rig = make_rig()
    after_effect(rig.engine, "resume", lambda tags: EngineMemory.WEIGHTS in tags)
    with pytest.raises(ActionFailed, match="Timeout"):
        rig.lifecycle.pause_grads()
        rig.lifecycle.update_weights()
    rig.lifecycle.recover()
    assert_back_in_train(rig)


# ---- E: the optimizer step moves the mains, then raises --------------------------------------------


@pytest.mark.parametrize("verify_cycles", [0, 2])
@pytest.mark.parametrize("mode", [Mode.REMATERIALIZE, Mode.BACKUP])
def test_e_a_step_that_moved_the_mains_then_raised_is_rebuilt(mode: Mode, verify_cycles: int) -> None:
    rig = make_rig(mode, verify_cycles=verify_cycles)
    cycle(rig)
    extra = rig.trainer.extra.clone()

    def step_dies_in_the_gather() -> None:
        rig.trainer.move_mains()
        raise Timeout("param all-gather: no answer")

    with pytest.raises(ActionFailed, match="all-gather"):
        rig.lifecycle.train(step_dies_in_the_gather)
    assert not torch.equal(rig.trainer.params["layer0.weight"], bf16_of_mains(rig.trainer)["layer0.weight"])
    rig.lifecycle.recover()
    assert torch.equal(rig.trainer.extra, extra), "the extras were not dropped: no stale stash comes back"
    assert_back_in_train(rig)
    for name, pushed in rig.engine.weights.items():
        if name in rig.trainer.params:
            assert torch.equal(pushed, rig.trainer.params[name]), "the update after recover pushed stale params"


def test_recover_reports_what_it_found_and_refuses_what_it_cannot_close() -> None:
    rig = make_rig()
    to_rollout(rig)
    rig.lifecycle.fault("a rank died")
    lc = rig.lifecycle
    real = rig.regions.resume
    rig.regions.resume = lambda tag: 0  # type: ignore[method-assign]  # says done, maps nothing
    with pytest.raises(ActionFailed) as failed:
        lc.recover()
    assert isinstance(failed.value.cause, RecoveryRefused)
    assert "is paused, after recover's calls returned" in str(failed.value.cause)
    assert lc.phase is Phase.FAULTED
    rig.regions.resume = real  # type: ignore[method-assign]
    lc.recover()
    assert_back_in_train(rig)
