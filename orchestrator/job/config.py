"""`RunConfig`: what `colocate run` runs, every option checked at once before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orchestrator.adapters.engines.sglang.group import url_problems
from orchestrator.adapters.registry import ENGINES
from orchestrator.core.config import Device, DigestMethod, EngineKind, EnginePause, WeightSync
from orchestrator.errors import ConfigError
from orchestrator.job.capacity import machine_problems
from orchestrator.job.grpo import GRPOConfig
from orchestrator.job.ray_cluster import address_problems, auth_problems
from orchestrator.job.workers.placement import in_process
from orchestrator.job.workers.pool import RANK_TIMEOUT_S
from states import Mode, Offload

# The longest --rank-timeout: far below what every wait it reaches can take (Ray's, in int64
# milliseconds; threading's TIMEOUT_MAX, 292 years; a socket's), and longer than any call should.
RANK_TIMEOUT_MAX_S = 7 * 24 * 3600.0
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits; the seed goes nowhere else


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    steps: int = 30
    ranks: int = 2
    mode: Mode = Mode.REMATERIALIZE
    # Which of grad_buffer, default leave the device for the rollout (orchestrator/core/offload.py).
    # `auto` decides from the measured budget on GPUs (`job.memory`); on the CPU it moves both.
    offload: Offload = Offload.AUTO
    verify_cycles: int = 2
    # How the verified cycles check their restores; None: the device digest on GPUs, SHA256 on
    # the CPU (`orchestrator.adapters.digest.default_digest`, which each rank applies).
    digest: DigestMethod | None = None
    seed: int = 0
    bucket_bytes: int = 1 << 20
    rank_timeout_s: float = RANK_TIMEOUT_S
    device: Device = Device.CPU
    engine: EngineKind = EngineKind.TRANSFORMERS
    engine_urls: tuple[str, ...] = ()
    weight_sync: WeightSync = WeightSync.TENSOR
    # How SGLang servers hold generation around an update; None: retract (the RL frameworks'
    # default), and for the transformers engine, which generates only inside the step, nothing.
    engine_pause: EnginePause | None = None
    # A running Ray cluster's GCS address (HOST:PORT) to run the ranks on; None: a private cluster
    # of the job's own, on loopback (`orchestrator.job.ray_cluster`).
    ray_address: str | None = None
    # Checkpoints (job/checkpoint.py): every N steps (0: never) into save_dir; resume from the last in resume.
    save_every: int = 0
    save_dir: Path | None = None
    resume: Path | None = None
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        problems = []
        # An engine served apart (SGLang) is reached by URL; one the job runs takes none.
        served = ENGINES[self.engine].served
        if served:
            problems += url_problems(
                self.engine_urls, label="--engine-url", missing="--engine sglang needs at least one --engine-url"
            )
        elif self.engine_urls:
            problems.append(f"--engine-url is for --engine sglang; the {self.engine} engine runs in this job")
        if self.engine_pause not in (None, EnginePause.NONE) and not served:
            problems.append(
                f"--engine-pause {self.engine_pause} is for --engine sglang; the {self.engine} engine generates "
                "only inside the step, never during an update"
            )
        if self.weight_sync is WeightSync.BROADCAST and not served:
            problems.append("--weight-sync broadcast is for --engine sglang, to servers off the trainer's GPUs")
        if self.device is Device.CUDA and not torch.cuda.is_available():
            problems.append("--device cuda: no CUDA device is visible to this process")
        if self.device is Device.CUDA and torch.cuda.is_available() and self.ranks > torch.cuda.device_count():
            problems.append(
                f"--device cuda --ranks {self.ranks}: one rank per GPU, and {torch.cuda.device_count()} GPU(s) are visible"
            )
        if self.device is Device.CUDA and self.ranks > 1 and served:
            problems.append("--device cuda --ranks N > 1 runs the transformers engine (a replica per GPU), not sglang")
        if self.ray_address is not None:
            problems += address_problems(self.ray_address)
        elif self.ranks >= 1 and not in_process(ranks=self.ranks, device=self.device.value, address=None):
            problems += self._private_cluster_problems(served)
        if self.steps < 1:
            problems.append(f"--steps must be at least 1, got {self.steps}")
        if self.ranks < 1:
            problems.append(f"--ranks must be at least 1, got {self.ranks}")
        if self.mode not in (Mode.REMATERIALIZE, Mode.BACKUP):
            problems.append(f"--mode must be rematerialize or backup, got {self.mode!r}")
        if self.offload not in Offload.__members__.values():
            problems.append(f"--offload must be one of {', '.join(Offload)}, got {self.offload!r}")
        if self.verify_cycles < 0:
            problems.append(f"--verify-cycles must be >= 0, got {self.verify_cycles}")
        if self.ranks >= 1 and self.grpo.prompts_per_step * self.grpo.group_size % self.ranks:
            rows = self.grpo.prompts_per_step * self.grpo.group_size
            problems.append(f"the {rows} samples of a step do not split evenly over {self.ranks} ranks")
        if not (math.isfinite(self.rank_timeout_s) and 0 < self.rank_timeout_s <= RANK_TIMEOUT_MAX_S):
            problems.append(
                f"--rank-timeout must be a positive number of seconds, at most {RANK_TIMEOUT_MAX_S:.0f} (a week), "
                f"got {self.rank_timeout_s}"
            )
        if not 0 <= self.seed <= SEED_MAX:
            problems.append(f"--seed must be >= 0 and < 2**64 (torch's generator takes 64 bits), got {self.seed}")
        if self.bucket_bytes < 1:
            problems.append(f"bucket size must be positive, got {self.bucket_bytes}")
        problems += checkpoint_problems(self)
        if problems:
            raise ConfigError(problems)

    def _private_cluster_problems(self, served: bool) -> list[str]:
        """A private Ray cluster runs on this machine, and only in token mode (`ray_cluster`)."""
        engine_processes = 0 if served else self.ranks if self.device is Device.CUDA else 1
        return auth_problems() + machine_problems(self.ranks, engine_processes=engine_processes)


def checkpoint_problems(config: RunConfig) -> list[str]:
    """The save and resume options' own problems (a resume's checkpoint is read by
    `job.checkpoint.resume_point`)."""
    problems = []
    if config.save_every < 0:
        problems.append(f"--save-every must be >= 0 (0: never), got {config.save_every}")
    if config.save_every > 0 and config.save_dir is None:
        problems.append("--save-every needs --save-dir: where the checkpoints go")
    if config.save_dir is not None and config.save_dir.exists() and not config.save_dir.is_dir():
        problems.append(f"--save-dir {config.save_dir}: not a folder")
    return problems
