"""The lifecycle's side of checkpoints: a due step ends with `save`, inside the step, under its
guards; a save that raises leaves the lifecycle FAULTED; a resumed lifecycle syncs after its
checkpoint's weight version. The controller's fakes stand in for Megatron and the engine."""

from __future__ import annotations

import pytest

from orchestrator import ActionFailed, GuardRejected, IllegalTransition
from orchestrator.core.config import LifecycleConfig
from orchestrator.core.lifecycle import Lifecycle
from orchestrator.protocols import Checkpointer, SavedCheckpoint
from orchestrator.telemetry.listeners import Listener, TransitionRecord
from orchestrator.testing import InMemoryEngine, InMemoryRegions, InMemoryTrainer, InMemoryTransport
from states import Event, Phase, Region
from tests.support.rig import make_rig


class EverySecond:
    def __init__(self, fail: bool = False) -> None:
        self.saved: list[tuple[int, int]] = []
        self.fail = fail

    def due(self, step: int) -> bool:
        return step % 2 == 0

    def save(self, step: int, weight_version: int) -> SavedCheckpoint:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.saved.append((step, weight_version))
        return SavedCheckpoint(path=f"/ck/step-{step:06d}", files=3, bytes=1234)


class Spans(Listener):
    def __init__(self) -> None:
        self.seen: list[tuple[int, Event, dict[str, object]]] = []

    def on_transition(self, record: TransitionRecord) -> None:
        self.seen.append((record.step, record.event, dict(record.attributes)))


def _step(lc: Lifecycle, trainer: InMemoryTrainer) -> None:
    with lc.step():
        lc.pause_grads()
        lc.update_weights()
        lc.drop_params()
        lc.rollout()
        lc.restore()
        lc.train(trainer.optimizer_step)


def test_a_due_step_ends_with_save_in_the_step_with_what_it_wrote() -> None:
    spans, saver = Spans(), EverySecond()
    rig = make_rig(listeners=(spans,))
    rig.lifecycle.checkpointer = saver
    assert isinstance(saver, Checkpointer)
    for _ in range(4):
        _step(rig.lifecycle, rig.trainer)
    assert saver.saved == [(2, 2), (4, 4)]  # each step's weights, as the engine serves them
    saves = [(step, attrs) for step, event, attrs in spans.seen if event is Event.SAVE]
    assert [step for step, _ in saves] == [2, 4]
    assert saves[0][1]["colocate.checkpoint"] == "/ck/step-000002" and saves[0][1]["colocate.bytes_written"] == 1234
    assert spans.seen[-1][1] is Event.SAVE  # the last transition of step 4


def test_save_is_refused_before_the_engine_serves_a_known_version_and_out_of_train() -> None:
    rig = make_rig()
    lc = rig.lifecycle
    with pytest.raises(GuardRejected, match="engine_version_known"):
        lc.save()
    _step(lc, rig.trainer)
    lc.save()  # synced, params whole
    lc.pause_grads()
    with pytest.raises(IllegalTransition, match="save is not legal in GRADS_PAUSED"):
        lc.save()


def test_save_is_refused_while_the_params_are_not_cast_mains() -> None:
    rig = make_rig()
    lc = rig.lifecycle
    _step(lc, rig.trainer)
    rig.trainer.optimizer_step()  # a step began outside `train`: the params no longer match the mains
    with pytest.raises(GuardRejected, match="params_valid"):
        lc.save()
    assert lc.phase is Phase.TRAIN


def test_a_save_that_raises_leaves_the_lifecycle_faulted_with_its_cause() -> None:
    rig = make_rig()
    rig.lifecycle.checkpointer = EverySecond(fail=True)
    _step(rig.lifecycle, rig.trainer)
    with pytest.raises(ActionFailed, match="No space left"):
        _step(rig.lifecycle, rig.trainer)
    assert rig.lifecycle.phase is Phase.FAULTED
    rig.lifecycle.recover()
    assert rig.lifecycle.phase is Phase.TRAIN and not rig.regions.paused


def test_a_resumed_lifecycle_pushes_the_version_after_its_checkpoint() -> None:
    trainer = InMemoryTrainer()
    engine = InMemoryEngine()
    regions = InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop})
    lc = Lifecycle(
        config=LifecycleConfig(), trainer=trainer, regions=regions, engine=engine,
        transport=InMemoryTransport(trainer, engine), resumed_version=12,
    )  # fmt: skip
    with lc.step(13):
        lc.pause_grads()
        lc.update_weights()
    assert engine.version == 13 and lc.weight_version == 13
