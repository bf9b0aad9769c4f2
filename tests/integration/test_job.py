"""The job in process (--ranks 1): the engine's weights are compared with the trainer's each sync."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from orchestrator.job import ColocatedJob, RunConfig
from orchestrator.listeners import Listener, TransitionRecord
from states import Event

pytestmark = pytest.mark.slow


class CorruptAfterSync(Listener):
    """Flips one bit of one engine weight right after the sync of step `step`."""

    def __init__(self, job: list[ColocatedJob], step: int) -> None:
        self.job, self.step = job, step

    def on_transition(self, record: TransitionRecord) -> None:
        if record.event is Event.UPDATE_WEIGHTS and record.step == self.step:
            weight = self.job[0].engine.target.engine.model.get_parameter("model.layers.0.mlp.down_proj.weight")
            weight.data.view(torch.int16).view(-1)[3] ^= 1


def test_a_corrupted_engine_weight_is_reported_as_a_mismatch() -> None:
    holder: list[ColocatedJob] = []
    job = ColocatedJob(RunConfig(steps=2, ranks=1), listeners=[CorruptAfterSync(holder, step=2)])
    holder.append(job)
    try:
        first, second = job.run_step(), job.run_step()
    finally:
        job.close()
    assert first.engine_matches_trainer is True
    assert second.engine_matches_trainer is False
    assert job.report.engine_matches_trainer is False
