"""The controller over the in-memory adapters: cycles, fences, faults, recovery, refusals."""

from __future__ import annotations

import pytest

from orchestrator import (
    ActionFailed,
    ConfigError,
    EngineError,
    GuardRejected,
    IllegalTransition,
    Lifecycle,
    LifecycleConfig,
    RegionRefused,
    RestoreMismatch,
)
from orchestrator.core.regions import RegionLedger
from orchestrator.testing import InMemoryRegions, InMemoryTrainer
from states import EngineMemory, Event, Mode, Phase, Region, TrainingSetup
from tests.support.rig import cycle, make_rig


@pytest.mark.parametrize("mode", [Mode.REMATERIALIZE, Mode.BACKUP])
def test_three_cycles_restore_bit_identical_and_versions_increase(mode: Mode) -> None:
    rig = make_rig(mode, verify_cycles=3)
    versions = []
    for _ in range(3):
        with rig.lifecycle.step():
            cycle(rig)
        versions.append(rig.engine.version)
        assert rig.lifecycle.last_restore_verified is True
    assert versions == [1, 2, 3]
    assert rig.engine.flushes == 3


def test_verification_stops_after_n_cycles() -> None:
    rig = make_rig(verify_cycles=1)
    cycle(rig)
    assert rig.lifecycle.last_restore_verified is True
    cycle(rig)
    assert rig.lifecycle.last_restore_verified is None


def test_backup_mode_pins_every_param_and_rematerialize_only_extras() -> None:
    pinned = {}
    for mode in (Mode.REMATERIALIZE, Mode.BACKUP):
        rig = make_rig(mode)
        rig.lifecycle.pause_grads()
        pinned[mode] = rig.trainer.host_pinned_bytes()
    assert pinned[Mode.REMATERIALIZE] == 4 * 4  # the fp32 stand-in for expert_bias
    assert pinned[Mode.BACKUP] == pinned[Mode.REMATERIALIZE] + 2 * 16 * 2


def test_flipped_bit_after_restore_names_tensor_and_cycle() -> None:
    rig = make_rig()
    cycle(rig)
    rig.trainer.corrupt_next_rebuild = "layer1.weight"
    rig.lifecycle.pause_grads()
    rig.lifecycle.update_weights()
    rig.lifecycle.drop_params()
    rig.lifecycle.rollout()
    with pytest.raises(ActionFailed) as info:
        rig.lifecycle.restore()
    mismatch = info.value.cause
    assert isinstance(mismatch, RestoreMismatch)
    assert mismatch.cycle == 1 and "layer1.weight" in str(mismatch)
    assert rig.lifecycle.phase is Phase.FAULTED


def test_critic_only_step_is_fenced_then_skipped() -> None:
    rig = make_rig()
    cycle(rig)
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    lc.rollout()
    lc.restore()  # a critic-only step: the actor does not train
    lc.pause_grads()
    with pytest.raises(GuardRejected) as info:
        lc.update_weights()
    assert [v.guard for v in info.value.verdicts] == ["weights_changed"]
    assert lc.phase is Phase.GRADS_PAUSED
    lc.skip_update()
    assert lc.phase is Phase.WEIGHTS_SYNCED and rig.engine.version == 2


def test_skip_is_refused_after_training() -> None:
    rig = make_rig()
    cycle(rig)
    rig.lifecycle.pause_grads()
    with pytest.raises(GuardRejected, match="weights_unchanged"):
        rig.lifecycle.skip_update()


def test_release_while_engine_busy_is_refused() -> None:
    rig = make_rig()
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    lc.rollout()
    rig.engine.busy = True
    with pytest.raises(GuardRejected, match="engine_idle"):
        lc.restore()
    assert lc.phase is Phase.ROLLOUT
    rig.engine.busy = False
    lc.restore()


def test_engine_reporting_stale_version_raises_engine_error() -> None:
    rig = make_rig()
    rig.lifecycle.pause_grads()
    original = rig.transport.push

    def push_and_roll_back(version: int):
        report = original(version)
        rig.engine.version = 0
        return report

    rig.transport.push = push_and_roll_back  # type: ignore[method-assign]
    with pytest.raises(ActionFailed) as info:
        rig.lifecycle.update_weights()
    assert isinstance(info.value.cause, EngineError) and "in-memory" in str(info.value.cause)


def test_fault_allows_only_recover_and_recovery_requires_a_fresh_sync() -> None:
    rig = make_rig()
    cycle(rig)
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    lc.fault("rank 1 died")
    for event in (Event.RESTORE, Event.ROLLOUT, Event.TRAIN, Event.FAULT):
        with pytest.raises(IllegalTransition):
            lc.fire(event)
    lc.recover()
    assert lc.phase is Phase.TRAIN and not rig.regions.paused
    assert rig.trainer.params["layer0.weight"].isfinite().all(), "recover rebuilds the dropped params"
    lc.pause_grads()
    with pytest.raises(GuardRejected, match="engine_synced"):
        lc.skip_update()  # a recovered engine must be synced, never skipped
    lc.update_weights()
    assert rig.engine.version == 3


def test_train_only_run_never_syncs() -> None:
    trainer = InMemoryTrainer()
    lc = Lifecycle(config=LifecycleConfig(mode=Mode.TRAIN_ONLY), trainer=trainer, regions=InMemoryRegions())
    lc.train(trainer.optimizer_step)
    lc.save()
    with pytest.raises(GuardRejected, match="train-only"):
        lc.pause_grads()


def test_wiring_errors_are_config_errors() -> None:
    trainer = InMemoryTrainer()
    with pytest.raises(ConfigError, match="needs an engine"):
        Lifecycle(config=LifecycleConfig(), trainer=trainer, regions=InMemoryRegions())
    with pytest.raises(ConfigError, match="lack tag 'grad_buffer'"):
        Lifecycle(
            config=LifecycleConfig(mode=Mode.TRAIN_ONLY),
            trainer=trainer,
            regions=InMemoryRegions({"param_buffer": 1, "default": 1}),
        )


def test_uncovered_param_fails_at_init_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"decoder\.frozen_scale: not rebuilt from the fp32 mains"):
        make_rig(trainer=InMemoryTrainer(uncovered=("decoder.frozen_scale",)))


def test_config_reports_every_violation_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        LifecycleConfig(setup=TrainingSetup(lora=True, overlap_param_gather=True), verify_cycles=-1)
    text = str(info.value)
    assert "3 configuration problem(s)" in text
    assert "no_lora" in text and "no_overlap_param_gather" in text and "verify_cycles" in text


def test_ledger_refuses_before_the_adapter_acts() -> None:
    regions = InMemoryRegions()
    ledger = RegionLedger(regions)
    ledger.pause("grad_buffer")
    with pytest.raises(RegionRefused, match="already paused"):
        ledger.pause("grad_buffer")
    with pytest.raises(RegionRefused, match="not paused"):
        ledger.resume("param_buffer")
    with pytest.raises(RegionRefused, match="unknown tag"):
        ledger.pause("kv_cache")
    assert regions.calls == [("pause", "grad_buffer")]


def test_engine_memory_follows_the_table() -> None:
    rig = make_rig()
    lc = rig.lifecycle
    assert rig.engine.resident == set(), "the engine is released when colocate takes it over"
    lc.pause_grads()
    lc.update_weights()
    assert rig.engine.resident == {EngineMemory.WEIGHTS}
    lc.drop_params()
    assert Region.PARAM_BUFFER.value in rig.regions.paused
    lc.rollout()
    assert rig.engine.resident == set(EngineMemory)
    lc.restore()
    assert rig.engine.resident == set() and not rig.regions.paused


def test_rollout_work_result_is_returned() -> None:
    rig = make_rig()
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    assert lc.rollout(lambda: "samples") == "samples"


def test_mode_accepts_its_name_and_rejects_unknown() -> None:
    assert LifecycleConfig(mode="backup").mode is Mode.BACKUP  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mode must be one of"):
        LifecycleConfig(mode="lazy")  # type: ignore[arg-type]


def test_versions_continue_from_what_an_attached_engine_serves() -> None:
    """An engine still serving an earlier job's version 7: this job pushes 8, and serves nothing before."""
    rig = make_rig()
    rig.engine.version = 7
    lc = Lifecycle(
        config=rig.lifecycle.config,
        trainer=rig.trainer,
        regions=rig.regions,
        engine=rig.engine,
        transport=rig.transport,
    )
    lc.pause_grads()
    with pytest.raises(IllegalTransition):
        lc.rollout()
    lc.update_weights()
    assert lc.weight_version == 8 and rig.engine.version == 8
