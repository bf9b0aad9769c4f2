"""The controller's configuration, validated whole when it is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from guards.config import violations
from guards.verdict import Verdict
from orchestrator.errors import ConfigError
from states import MemoryBudget, Mode, Offload, TrainingSetup


@dataclass(frozen=True, kw_only=True, slots=True)
class LifecycleConfig:
    """How the controller runs one rank.

    `verify_cycles`: for the first N drop/restore cycles, digest every param at the drop and
    check the restore against it (2 by default: the second cycle also catches param-gather
    state damage that only shows one step later).

    `recover_idle_timeout_s`: how long `recover` waits for the engine's requests in flight to
    finish before it refuses (an engine is never released while busy).

    `offload`: which of `grad_buffer` and `default` leave the device for the rollout
    (core/offload.py). `auto` decides from `memory` at construction; without it, both move.
    """

    mode: Mode = Mode.REMATERIALIZE
    verify_cycles: int = 2
    recover_idle_timeout_s: float = 30.0
    rank: int = 0
    setup: TrainingSetup = field(default_factory=TrainingSetup)
    # The memory-budget guard's input, read for each snapshot (orchestrator.plan.MemoryProbe);
    # None leaves memory unchecked.
    memory: Callable[[], MemoryBudget] | None = None
    offload: Offload = Offload.AUTO

    def __post_init__(self) -> None:
        if self.mode not in Mode.__members__.values():
            raise ConfigError([f"mode must be one of {', '.join(Mode)}, got {self.mode!r}"])
        if self.offload not in Offload.__members__.values():
            raise ConfigError([f"offload must be one of {', '.join(Offload)}, got {self.offload!r}"])
        object.__setattr__(self, "mode", Mode(self.mode))  # accept "backup" as well as Mode.BACKUP
        object.__setattr__(self, "offload", Offload(self.offload))
        problems: list[Verdict | str] = [*violations(self.mode, self.setup)]
        if self.verify_cycles < 0:
            problems.append(f"verify_cycles must be >= 0, got {self.verify_cycles}")
        if not self.recover_idle_timeout_s >= 0:
            problems.append(f"recover_idle_timeout_s must be >= 0, got {self.recover_idle_timeout_s}")
        if self.rank < 0:
            problems.append(f"rank must be >= 0, got {self.rank}")
        if problems:
            raise ConfigError(problems)


class EngineKind(StrEnum):
    """The rollout engine of `colocate run`."""

    TRANSFORMERS = "transformers"  # a Hugging Face Llama the job starts itself
    SGLANG = "sglang"  # running SGLang servers, one --engine-url each


class WeightSync(StrEnum):
    """How `colocate run` moves weights into SGLang servers."""

    TENSOR = "tensor"  # /update_weights_from_tensor: CUDA IPC, servers on the trainer's GPUs
    BROADCAST = "broadcast"  # /update_weights_from_distributed: a NCCL group, servers off them


class EnginePause(StrEnum):
    """How `colocate run` holds an SGLang server's generation around a weight update
    (`SGLangEngine.pause_generation` says what each mode does there)."""

    RETRACT = "retract"  # requests requeued, their KV cache freed; recomputed under the new weights
    ABORT = "abort"  # requests aborted (returned to their callers) until the server is idle
    IN_PLACE = "in_place"  # requests and their KV cache kept; SGLang then refuses /flush_cache
    NONE = "none"  # nothing sent: the lifecycle's idle checks alone


class Device(StrEnum):
    """Where the trainer ranks of `colocate run` train."""

    CPU = "cpu"
    CUDA = "cuda"


class DigestMethod(StrEnum):
    """How a verified cycle proves its restore bit-identical (`orchestrator.adapters.digest`)."""

    DEVICE = "device"  # sums over the words, where the tensors live
    SHA256 = "sha256"  # of every byte, on the host


@dataclass(frozen=True, kw_only=True, slots=True)
class Verify:
    """How many drop/restore cycles are checked bit-identical, and how (`--verify-cycles`,
    `--digest`; `colocate_megatron(verify=)`).

    `cycles`: the first N cycles digest every param at the drop and check the restore against it.
    `digest`: how; None lets each rank's trainer choose by its params' device (the device digest
    on a GPU, SHA256 on the CPU: `orchestrator.adapters.digest.default_digest`)."""

    cycles: int = 2
    digest: DigestMethod | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    """Where checkpoints go and which one a run continues from (`--save-every`, `--save-dir`,
    `--resume`; `colocate_megatron(checkpoint=)`).

    `save_every`: a checkpoint every N steps (0: never) into `save_dir`. `resume`: a folder whose
    last complete checkpoint the run continues from. `state`: the embedding's own JSON-able state
    (a sampler's position, say), called on rank 0 at each save; `colocate run` saves its own.
    A path given as a string is taken as a `Path`. Checked where it is used, each user naming
    its own options (`RunConfig`, `MegatronCheckpointer`)."""

    save_dir: Path | None = None
    save_every: int = 0
    resume: Path | None = None
    state: Callable[[], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        for name in ("save_dir", "resume"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, Path(value))

    @property
    def used(self) -> bool:
        """Whether anything is saved or loaded."""
        return bool(self.save_every) or self.save_dir is not None or self.resume is not None or self.state is not None
