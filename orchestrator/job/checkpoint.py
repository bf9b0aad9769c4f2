"""`colocate run --save-every N --save-dir DIR` and `--resume DIR`: the job's checkpoints.

A checkpoint is a directory of the store (`orchestrator.adapters.checkpoints`), complete only
once renamed into place:

    DIR/step-000012/trainer/       every rank's part: Megatron's dist checkpoint of the model,
                                   the optimizer (fp32 mains and Adam moments) and its RNG states
    DIR/step-000012/colocate.json  the run's part: its step, the weight version the engine served,
                                   the rollout sampler's state, what the run is (`identity`), and
                                   its report so far
    DIR/step-000012/MANIFEST.json  every file's bytes and SHA256, written last

`JobCheckpointer` is the lifecycle's `Checkpointer`: the `save` it fires at the end of a due step
runs it. `resume_point` reads the last complete checkpoint before any rank starts, and refuses
(a ConfigError, exit 2) one that is damaged, of another model, task, mode or seed, or already
at the run's last step. Another number of ranks is resharded by Megatron (the optimizer is saved
`dp_reshardable`); the ranks' RNG states are then left as they start, and the steps after it
are not an unbroken run's (each rank trains on another shard of the batch).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import trace

from orchestrator.adapters import checkpoints as store
from orchestrator.job.layout import model_parallel
from orchestrator.job.report import RunReport
from orchestrator.protocols import SavedCheckpoint
from orchestrator.telemetry import semconv

if TYPE_CHECKING:
    from orchestrator.job.config import RunConfig
    from orchestrator.job.workers.facades import DistributedTrainer


def identity(config: RunConfig) -> dict[str, Any]:
    """What a resumed run must share with its checkpoint for its steps to be the same run's; and
    where a rank holds part of the model, the layout (the optimizer is saved `dp_reshardable`:
    Megatron reshards it over DP only)."""
    same = {"mode": config.mode.value, "seed": config.seed, "grpo": asdict(config.grpo)}
    if model_parallel(config.layout):  # a DP-only checkpoint, saved before the layout was, names none
        same["layout"] = {"tp": config.tp, "pp": config.pp, "ep": config.ep}
    return same


def _differences(saved: Any, now: Any, key: str = "") -> list[str]:
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        return [d for k in sorted(set(saved) | set(now)) for d in _differences(saved.get(k), now.get(k), f"{key}.{k}")]
    return [] if saved == now else [f"{key.lstrip('.')}: the checkpoint's run has {saved!r}, this one {now!r}"]


@dataclass(frozen=True)
class ResumePoint:
    """The last complete checkpoint, verified: where a resumed run starts."""

    path: Path
    step: int
    weight_version: int
    ranks: int
    sampler: bytes  # the rollout generator's state (torch.Generator.get_state)
    report: dict[str, Any]

    def load(self, trainer: DistributedTrainer, sampler: torch.Generator, report: RunReport, ranks: int) -> int:
        """Every rank loads the checkpoint (its RNG states too, where `ranks` is the saved number);
        the sampler continues from its state, and `report` (in place) from the report so far,
        marked resumed. Returns the step the run continues after."""
        start = time.perf_counter()
        trainer.load_checkpoint(str(self.path / store.TRAINER), self.ranks == ranks)
        sampler.set_state(torch.frombuffer(bytearray(self.sampler), dtype=torch.uint8))
        vars(report).update(vars(RunReport.from_dict(self.report)))
        report.resumed.append(f"step {self.step} from {self.path}")
        report.resume_seconds = round(time.perf_counter() - start, 3)
        trace.get_current_span().set_attributes({semconv.CHECKPOINT: str(self.path), semconv.STEP: self.step})
        return self.step


def resume_point(config: RunConfig) -> ResumePoint:
    """Read and verify the last complete checkpoint under `config.checkpoint.resume`; CheckpointRefused
    (a ConfigError) names the file that is missing or damaged, or each way the run differs."""
    assert config.checkpoint.resume is not None
    path = store.latest(config.checkpoint.resume)
    store.verify(path)
    state_file = path / store.RUN_FILE
    try:
        state = json.loads(state_file.read_text())
        point = ResumePoint(
            path=path,
            step=int(state["step"]),
            weight_version=int(state["weight_version"]),
            ranks=int(state["ranks"]),
            sampler=base64.b64decode(state["sampler"]),
            report=dict(state["report"]),
        )
        saved_as = dict(state["identity"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise store.CheckpointRefused([f"{state_file}: not a colocate run's ({type(exc).__name__}: {exc})"]) from None
    problems = [f"--resume {path}: {d}" for d in _differences(saved_as, identity(config))]
    if point.step >= config.steps:
        problems.append(
            f"--resume {path}: the checkpoint is at step {point.step}; --steps {config.steps} leaves none to run"
        )
    if problems:
        raise store.CheckpointRefused(problems)
    return point


class JobCheckpointer:
    """The job's `Checkpointer`: every rank writes its part, then the run writes its own (the
    sampler's state and `report` as they are at the save), then the store seals the folder into place."""

    def __init__(
        self, config: RunConfig, trainer: DistributedTrainer, sampler: torch.Generator, report: RunReport
    ) -> None:
        assert config.checkpoint.save_dir is not None
        self.root, self.every = config.checkpoint.save_dir, config.checkpoint.save_every
        self._identity, self._ranks = identity(config), config.ranks
        self._trainer, self._sampler, self._report = trainer, sampler, report

    @classmethod
    def of(
        cls, config: RunConfig, trainer: DistributedTrainer, sampler: torch.Generator, report: RunReport
    ) -> JobCheckpointer | None:
        """The run's checkpointer, or None where it saves nothing (no --save-dir)."""
        return None if config.checkpoint.save_dir is None else cls(config, trainer, sampler, report)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, weight_version: int) -> SavedCheckpoint:
        partial = store.begin(self.root, step)
        self._trainer.save_checkpoint(str(partial / store.TRAINER))
        state = {
            "step": step,
            "weight_version": weight_version,
            "ranks": self._ranks,
            "identity": self._identity,
            "sampler": base64.b64encode(self._sampler.get_state().numpy().tobytes()).decode(),
            "report": asdict(self._report),
        }
        (partial / store.RUN_FILE).write_text(json.dumps(state, indent=1) + "\n")
        return store.seal(partial, self.root, step)
