"""`resume_point`: what a resumed `colocate run` reads and refuses before any rank starts. The
checkpoint is made by the real store with a stand-in trainer folder (no Megatron here: the e2e
tests resume real ones)."""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from orchestrator.adapters.checkpoints import CheckpointRefused, begin, seal
from orchestrator.core.config import Checkpoint
from orchestrator.errors import ConfigError
from orchestrator.job.checkpoint import identity, resume_point
from orchestrator.job.config import RunConfig
from orchestrator.job.grpo import GRPOConfig
from orchestrator.job.report import RunReport, StepReport
from states import Mode


def _checkpoint(root: Path, config: RunConfig, step: int, **state: object) -> None:
    partial = begin(root, step)
    (partial / "trainer" / "__0_0.distcp").write_bytes(b"shard")
    report = RunReport(
        mode=config.mode.value, ranks=config.ranks, steps=[StepReport(step=s) for s in range(1, step + 1)]
    )
    run = {
        "step": step, "weight_version": step, "ranks": config.ranks, "identity": identity(config),
        "sampler": base64.b64encode(torch.Generator().manual_seed(5).get_state().numpy().tobytes()).decode(),
        "report": asdict(report),
    } | state  # fmt: skip
    (partial / "colocate.json").write_text(json.dumps(run))
    seal(partial, root, step)


def test_the_last_complete_checkpoint_is_read_whole(tmp_path: Path) -> None:
    config = RunConfig(ranks=1, steps=6, checkpoint=Checkpoint(resume=tmp_path))
    _checkpoint(tmp_path, config, 2)
    _checkpoint(tmp_path, config, 4)
    point = resume_point(config)
    assert (point.path.name, point.step, point.weight_version, point.ranks) == ("step-000004", 4, 4, 1)
    assert [s["step"] for s in point.report["steps"]] == [1, 2, 3, 4]
    sampler = torch.Generator().set_state(torch.frombuffer(bytearray(point.sampler), dtype=torch.uint8))
    assert torch.equal(sampler.get_state(), torch.Generator().manual_seed(5).get_state())


def test_another_run_is_refused_naming_each_difference(tmp_path: Path) -> None:
    saved = RunConfig(ranks=1, steps=6)
    _checkpoint(tmp_path, saved, 2)
    wider = replace(saved.grpo.model, hidden_size=128)
    other = RunConfig(
        ranks=1, steps=6, checkpoint=Checkpoint(resume=tmp_path), mode=Mode.BACKUP, grpo=GRPOConfig(model=wider)
    )
    with pytest.raises(CheckpointRefused) as refused:
        resume_point(other)
    said = str(refused.value)
    assert "grpo.model.hidden_size: the checkpoint's run has 64, this one 128" in said
    assert "mode: the checkpoint's run has 'rematerialize', this one 'backup'" in said


def test_a_run_file_of_another_shape_is_refused_naming_it(tmp_path: Path) -> None:
    config = RunConfig(ranks=1, steps=6, checkpoint=Checkpoint(resume=tmp_path))
    _checkpoint(tmp_path, config, 2, identity=None)
    with pytest.raises(CheckpointRefused, match=r"colocate\.json: not a colocate run's \(TypeError"):
        resume_point(config)


def test_a_checkpoint_at_the_last_step_leaves_nothing_to_run(tmp_path: Path) -> None:
    config = RunConfig(ranks=1, steps=4, checkpoint=Checkpoint(resume=tmp_path))
    _checkpoint(tmp_path, config, 4)
    with pytest.raises(CheckpointRefused, match="the checkpoint is at step 4; --steps 4 leaves none to run"):
        resume_point(config)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"save_every": -1}, "--save-every must be >= 0"),
        ({"save_every": 2}, "--save-every needs --save-dir"),
    ],
)
def test_save_options_are_checked_with_the_rest(changes: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        RunConfig(ranks=1, checkpoint=Checkpoint(**changes))  # type: ignore[arg-type]
