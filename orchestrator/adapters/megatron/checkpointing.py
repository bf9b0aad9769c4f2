"""Checkpoints of a Megatron trainer's run, for `Lifecycle(checkpointer=...)`: every rank saves
its part collectively, and a resume loads the last complete checkpoint on every rank.

    checkpointer = MegatronCheckpointer(chunks, optimizer, save_dir=DIR, every=100, state=sampler_state)
    point = checkpointer.resume(DIR)    # every rank, before the trainer is wrapped; also `.resumed`

A checkpoint is a directory of the store (`orchestrator.adapters.checkpoints`), complete only
once renamed into place:

    DIR/step-000200/trainer/        Megatron's dist checkpoint: model, optimizer shards, RNG (`sharded`)
    DIR/step-000200/colocate.json   step, weight_version, world_size, parallel layout, the trainer's `state`
    DIR/step-000200/MANIFEST.json   every file's bytes and SHA256

`DIR` must be one directory every rank sees (a shared filesystem), as Megatron's checkpoints need.
Rank 0 makes the partial directory, writes `colocate.json` and seals; every rank writes its shard.
`weight_version` is the version the engine serves when the step ends (the one before this step's
training); a resumed run's first sync pushes the one after it.

Each collective step ends with every rank learning every rank's outcome, so a failure on one
rank (rank 0's seal, a rank's write, a refused checkpoint) raises on every rank instead of leaving
the others waiting: the rank that failed raises its own error, the others `CheckpointFailed`
naming it. A failure inside Megatron's own collectives can still leave the others in them.

A resume refuses (`CheckpointRefused`, on every rank, before anything is loaded) a directory with
no complete checkpoint, a file of the last one missing, truncated or changed, or a checkpoint of
another model (Megatron's `CheckpointingException`, named). A checkpoint saved at another data-
parallel size loads (`ResumePoint.resharded`); the RNG states are restored only where the parallel
layout is the one saved.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException

from orchestrator.adapters.checkpoints import store
from orchestrator.adapters.checkpoints.store import CheckpointRefused
from orchestrator.adapters.megatron import sharded
from orchestrator.errors import ConfigError
from orchestrator.protocols import SavedCheckpoint

__all__ = ["CheckpointFailed", "MegatronCheckpointer", "ResumePoint"]


class CheckpointFailed(RuntimeError):
    """Another rank's part of a save or a load failed; this rank stopped with it."""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a resumed run continues: after `step`, with the engine to be synced past
    `weight_version`; `state` is what the trainer saved beside (its sampler's position, say)."""

    step: int
    weight_version: int
    state: dict[str, Any]
    path: str
    resharded: bool  # saved at another parallel layout (another data-parallel size, say)


def _layout() -> dict[str, int]:
    return {
        "world": torch.distributed.get_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
    }


def _from_rank0(value: Any) -> Any:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _all_outcomes(error: BaseException | None, what: str) -> None:
    """Every rank learns every rank's outcome of `what`; a rank that failed re-raises its own
    error, the others CheckpointFailed naming the first rank that failed."""
    outcomes: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
    if failed:
        rank, text = failed[0]
        raise CheckpointFailed(f"{what} failed on rank {rank}: {text}")


def _attempt(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except Exception as error:
        return None, error


def _load(chunks: Sequence[Any], optimizer: Any, path: Path, *, rng: bool) -> None:
    """`sharded.load`; Megatron's refusal of another model's checkpoint as CheckpointRefused.
    torch's checkpoint loader raises Megatron's inside its own CheckpointException (a
    BaseException), one per rank that failed."""
    try:
        sharded.load(chunks, optimizer, path / store.TRAINER, rng=rng)
    except CheckpointingException as error:
        raise CheckpointRefused([f"{path}: does not fit this model (Megatron: {error})"]) from None
    except CheckpointException as error:
        causes = [cause for cause, _ in error.failures.values()]
        said = "; ".join(dict.fromkeys(f"{type(c).__name__}: {c}" for c in causes))
        if all(isinstance(cause, CheckpointingException) for cause in causes):
            said = "; ".join(dict.fromkeys(str(c) for c in causes))
            raise CheckpointRefused([f"{path}: does not fit this model (Megatron: {said})"]) from None
        raise RuntimeError(f"loading {path} failed: {said}") from None


def _read(root: Path) -> tuple[str, dict[str, Any]]:
    """The last complete checkpoint under `root`, verified, and its run file."""
    path = store.latest(root)
    store.verify(path)
    try:
        run = json.loads((path / store.RUN_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointRefused([f"{path / store.RUN_FILE}: unreadable ({error}): not a colocate checkpoint"]) from None
    return str(path), run


def _verdict_from_rank0(
    found: tuple[str, dict[str, Any]] | None, error: BaseException | None, root: Path
) -> tuple[str, dict[str, Any]]:
    """Rank 0's reading of the checkpoint, on every rank: its refusal raised on every rank."""
    if isinstance(error, CheckpointRefused):
        verdict: tuple[str, Any] = ("refused", list(error.violations))
    elif error is not None:
        verdict = ("failed", f"{type(error).__name__}: {error}")
    else:
        verdict = ("found", found)
    kind, detail = _from_rank0(verdict)
    if kind == "refused":
        raise CheckpointRefused(detail)
    if kind == "failed":
        raise CheckpointFailed(f"reading the checkpoint under {root} failed on rank 0: {detail}")
    return detail


class MegatronCheckpointer:
    """The `Checkpointer` of one rank of a Megatron trainer (see the module docstring).

    `every`: save at the end of every `every`th step (0: never; a resume-only checkpointer).
    `state`: called on rank 0 at each save, the trainer's own JSON-able state, saved beside.
    `resumed`: the `ResumePoint` of the last `resume`, None before one.
    """

    def __init__(
        self,
        chunks: Sequence[Any],
        optimizer: Any,
        *,
        save_dir: str | Path | None,
        every: int = 0,
        state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        problems = []
        if not isinstance(every, int) or every < 0:
            problems.append(f"save_every must be a whole number of steps, 0 or more (0: never), got {every!r}")
        elif every and save_dir is None:
            problems.append(f"save_every={every} needs save_dir: where the checkpoints go")
        if problems:
            raise ConfigError(problems)
        self.chunks, self.optimizer, self.every, self.state = list(chunks), optimizer, every, state
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.resumed: ResumePoint | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, weight_version: int) -> SavedCheckpoint:
        """Every rank, collectively; the complete checkpoint on every rank once it returns."""
        if self.save_dir is None:
            raise ConfigError([f"step {step}: a save with no save_dir"])
        root, rank = self.save_dir, torch.distributed.get_rank()
        partial, error = _attempt(lambda: store.begin(root, step)) if rank == 0 else (None, None)
        _all_outcomes(error, f"making {root}/.partial-step-{step:06d}")
        partial = Path(_from_rank0(None if partial is None else str(partial)))
        _, error = _attempt(lambda: sharded.save(self.chunks, self.optimizer, partial / store.TRAINER))
        _all_outcomes(error, f"writing the trainer's shards of step {step}")
        saved, error = _attempt(lambda: self._seal(root, partial, step, weight_version)) if rank == 0 else (None, None)
        _all_outcomes(error, f"sealing {root}/step-{step:06d}")
        return SavedCheckpoint(*_from_rank0(None if saved is None else (saved.path, saved.files, saved.bytes)))

    def _seal(self, root: Path, partial: Path, step: int, weight_version: int) -> SavedCheckpoint:
        run = {
            "step": step,
            "weight_version": weight_version,
            "world_size": torch.distributed.get_world_size(),
            "layout": _layout(),
            "state": self.state() if self.state is not None else {},
        }
        (partial / store.RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")
        return store.seal(partial, root, step)

    def resume(self, directory: str | Path) -> ResumePoint:
        """Load the last complete checkpoint under `directory` into the model and the optimizer
        (every rank, collectively). CheckpointRefused on every rank, before anything is loaded,
        where it is missing, damaged or another model's (see the module docstring)."""
        root = Path(directory)
        found, error = _attempt(lambda: _read(root)) if torch.distributed.get_rank() == 0 else (None, None)
        path, run = _verdict_from_rank0(found, error, root)
        same = run.get("layout") == _layout()
        _, error = _attempt(lambda: _load(self.chunks, self.optimizer, Path(path), rng=same))
        _all_outcomes(error, f"loading {path}")
        self.resumed = ResumePoint(
            step=int(run["step"]),
            weight_version=int(run["weight_version"]),
            state=dict(run["state"]),
            path=path,
            resharded=not same,
        )
        return self.resumed
