"""The bad day, through the public API: each test injects one failure of issue 10 and asserts the
state the promise names afterwards (docs/lifecycle.md: "Refusals and faults" and the recovery table)."""

from __future__ import annotations

import pytest
import torch

import guards
from orchestrator import ActionFailed, GuardRejected, IllegalTransition, LifecycleError
from orchestrator.errors import FaultWithoutCause, RecoveryRefused
from states import TABLE, EngineMemory, Event, Mode, Phase
from tests.support.rig import Rig, cycle, make_rig, to_rollout


def _bf16_of_mains(rig: Rig) -> dict[str, torch.Tensor]:
    return {n: m.to(torch.bfloat16) for n, m in rig.trainer.mains.items()}


# ---- item 1: recover keeps bad params --------------------------------------------------------


def test_recover_rebuilds_params_after_a_failed_rebuild() -> None:
    rig = make_rig()
    to_rollout(rig)
    original = rig.trainer.rebuild

    def rebuild_then_die(mode: Mode) -> int:
        original(mode)
        rig.trainer.drop()  # died half-way: the params are garbage, the buffer is resident
        raise RuntimeError("all-gather timed out")

    rig.trainer.rebuild = rebuild_then_die  # type: ignore[method-assign]
    with pytest.raises(ActionFailed):
        rig.lifecycle.restore()
    rig.trainer.rebuild = original  # type: ignore[method-assign]
    rig.lifecycle.recover()
    assert rig.lifecycle.phase is Phase.TRAIN
    for name, expected in _bf16_of_mains(rig).items():
        assert torch.equal(rig.trainer.params[name], expected), f"{name} is not the rebuilt param"


@pytest.mark.parametrize("mode", [Mode.REMATERIALIZE, Mode.BACKUP])
def test_recover_rebuilds_params_after_a_restore_mismatch(mode: Mode) -> None:
    rig = make_rig(mode)
    to_rollout(rig)
    rig.trainer.corrupt_next_rebuild = "layer1.weight"
    with pytest.raises(ActionFailed):
        rig.lifecycle.restore()
    rig.lifecycle.recover()
    assert rig.lifecycle.last_restore_verified is True, "recover verified its rebuild against the drop's digests"
    for name, expected in _bf16_of_mains(rig).items():
        assert torch.equal(rig.trainer.params[name], expected), f"{name} stayed corrupted"
    rig.lifecycle.pause_grads()
    rig.lifecycle.update_weights()
    assert torch.equal(rig.engine.weights["layer1.weight"], _bf16_of_mains(rig)["layer1.weight"])


def test_recover_that_cannot_verify_its_rebuild_refuses_and_stays_faulted() -> None:
    rig = make_rig()
    to_rollout(rig)
    original = rig.trainer.rebuild

    def always_corrupt(mode: Mode) -> int:
        rig.trainer.corrupt_next_rebuild = "layer0.weight"
        return original(mode)

    rig.trainer.rebuild = always_corrupt  # type: ignore[method-assign]
    with pytest.raises(ActionFailed):
        rig.lifecycle.restore()
    with pytest.raises(ActionFailed) as info:
        rig.lifecycle.recover()
    assert isinstance(info.value.cause, RecoveryRefused) and "layer0.weight" in str(info.value.cause)
    assert rig.lifecycle.phase is Phase.FAULTED


# ---- item 2: recover releases a busy engine --------------------------------------------------


def test_recover_waits_for_a_busy_engine_then_refuses_without_releasing() -> None:
    rig = make_rig(recover_idle_timeout_s=0.0)
    to_rollout(rig)
    rig.engine.busy = True
    rig.lifecycle.fault("rank 1 died mid-rollout")
    calls = len(rig.engine.calls)
    with pytest.raises(ActionFailed) as info:
        rig.lifecycle.recover()
    assert isinstance(info.value.cause, RecoveryRefused) and "in flight" in str(info.value.cause)
    assert rig.engine.calls[calls:] == [], "no release reached the busy engine"
    assert rig.lifecycle.phase is Phase.FAULTED
    rig.engine.busy = False
    rig.lifecycle.recover()
    assert rig.lifecycle.phase is Phase.TRAIN and rig.engine.resident == set()


def test_recover_waits_a_bounded_time_for_the_engine_to_go_idle() -> None:
    rig = make_rig(recover_idle_timeout_s=5.0)
    to_rollout(rig)
    rig.engine.busy = True
    polls = []

    def idle_after_three_polls() -> bool:
        polls.append(1)
        rig.engine.busy = len(polls) < 3
        return not rig.engine.busy

    rig.engine.is_idle = idle_after_three_polls  # type: ignore[method-assign]
    rig.lifecycle.fault("rank 1 died mid-rollout")
    rig.lifecycle.recover()
    assert rig.lifecycle.phase is Phase.TRAIN and len(polls) >= 3


# ---- item 3: a failed flush deadlocks the run ------------------------------------------------


def test_recover_after_a_failed_flush_lets_the_run_continue() -> None:
    rig = make_rig()
    rig.lifecycle.pause_grads()

    def broken_flush() -> None:
        raise RuntimeError("flush_cache: 400 while requests run")

    rig.engine.flush_cache = broken_flush  # type: ignore[method-assign]
    with pytest.raises(ActionFailed):
        rig.lifecycle.update_weights()
    del rig.engine.flush_cache
    rig.lifecycle.recover()
    cycle(rig)
    assert rig.engine.version == 2 and rig.lifecycle.weight_version == 2


# ---- item 4: the first cause is lost ---------------------------------------------------------


def test_the_first_cause_is_kept_and_later_ones_become_notes() -> None:
    rig = make_rig()
    first = RuntimeError("rank 1 died")
    rig.lifecycle.fault(first)
    with pytest.raises(IllegalTransition):
        rig.lifecycle.fault("watchdog fired")
    assert rig.lifecycle.fault_cause is first
    assert any("watchdog fired" in note for note in getattr(first, "__notes__", []))


def test_a_fault_needs_a_cause() -> None:
    rig = make_rig()
    with pytest.raises(FaultWithoutCause):
        rig.lifecycle.fire(Event.FAULT)
    assert rig.lifecycle.phase is Phase.TRAIN and rig.lifecycle.fault_cause is None


def test_a_failed_recover_is_a_note_on_the_kept_cause() -> None:
    rig = make_rig(recover_idle_timeout_s=0.0)
    to_rollout(rig)
    rig.engine.busy = True
    first = RuntimeError("rank 1 died")
    rig.lifecycle.fault(first)
    with pytest.raises(ActionFailed):
        rig.lifecycle.recover()
    assert rig.lifecycle.fault_cause is first
    assert any("recover" in note for note in getattr(first, "__notes__", []))


# ---- item 5: the critic-only step fails ------------------------------------------------------


def test_critic_only_step_rolls_out_with_the_engine_weights_resident() -> None:
    rig = make_rig()
    cycle(rig)
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()  # the fence: trained since the last sync
    lc.drop_params()
    lc.rollout()
    lc.restore()
    assert EngineMemory.WEIGHTS not in rig.engine.resident
    lc.pause_grads()
    lc.skip_update()  # critic-only: nothing trained
    assert EngineMemory.WEIGHTS in rig.engine.resident
    lc.drop_params()
    assert lc.rollout(rig.engine.generate) == 2, "served the weights of version 2"
    assert torch.equal(rig.engine.weights["layer0.weight"], _bf16_of_mains(rig)["layer0.weight"])
    lc.restore()


def test_rollout_row_requires_the_engine_weights_resident() -> None:
    rows = {(r.source, r.event): r for r in TABLE}
    assert "engine_weights_resident" in rows[(Phase.PARAMS_DROPPED, Event.ROLLOUT)].guards


# ---- item 9: a dead engine blocks fault() ----------------------------------------------------


def test_fault_reaches_faulted_with_the_engine_dead() -> None:
    rig = make_rig()

    def dead() -> int:
        raise ConnectionError("engine actor died")

    rig.engine.weight_version = dead  # type: ignore[assignment,method-assign]
    rig.engine.is_idle = dead  # type: ignore[assignment,method-assign]
    rig.lifecycle.fault("engine actor died")
    assert rig.lifecycle.phase is Phase.FAULTED


# ---- item 10: a guard hides inside an action -------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.REMATERIALIZE, Mode.BACKUP])
def test_only_the_guards_of_its_row_judge_an_event(mode: Mode, monkeypatch: pytest.MonkeyPatch) -> None:
    consulted: list[tuple[Phase, str]] = []
    rig = make_rig(mode)
    for name, check in list(guards.GUARDS.items()):

        def spy(snap, _name=name, _check=check):  # type: ignore[no-untyped-def]
            consulted.append((snap.phase, _name))
            return _check(snap)

        monkeypatch.setitem(guards.GUARDS, name, spy)
    rows = {(r.source, r.event): r for r in TABLE}
    for _ in range(2):
        for event in (Event.PAUSE_GRADS, Event.UPDATE_WEIGHTS, Event.DROP_PARAMS, Event.ROLLOUT, Event.RESTORE):
            phase = rig.lifecycle.phase
            consulted.clear()
            rig.lifecycle.fire(event)
            assert {g for _, g in consulted} <= set(rows[(phase, event)].guards), event
        rig.lifecycle.train(rig.trainer.optimizer_step)


def test_lifecycle_error_is_the_base_of_the_new_errors() -> None:
    assert issubclass(RecoveryRefused, LifecycleError) and issubclass(FaultWithoutCause, LifecycleError)
    assert GuardRejected is not None
