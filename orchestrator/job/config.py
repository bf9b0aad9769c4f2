"""`RunConfig`: what `colocate run` runs, every option checked at once before anything starts.

The config is pure: building one reads nothing of the machine. What the run needs of the
machine (cores, memory, GPUs, the environment's Ray settings) is judged apart, once, by
`job.preflight`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from orchestrator.adapters.engines.sglang.group import url_problems
from orchestrator.adapters.registry import ENGINES
from orchestrator.core.config import Checkpoint, Device, EngineKind, EnginePause, Verify, WeightSync
from orchestrator.errors import ConfigError
from orchestrator.job.grpo import GRPOConfig
from orchestrator.job.layout import given_sizes, layout_problems, model_parallel, run_layout
from orchestrator.job.ray_cluster import address_problems
from orchestrator.job.workers.pool import RANK_TIMEOUT_S
from orchestrator.plan.memory import Parallelism
from states import Mode, Offload

# The longest --rank-timeout: far below what every wait it reaches can take (Ray's, in int64
# milliseconds; threading's TIMEOUT_MAX, 292 years; a socket's), and longer than any call should.
RANK_TIMEOUT_MAX_S = 7 * 24 * 3600.0
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits; the seed goes nowhere else


@dataclass(frozen=True, kw_only=True, slots=True)
class Engine:
    """The rollout engine and how weights reach it (`--engine`, `--engine-url`, `--weight-sync`,
    `--engine-pause`)."""

    kind: EngineKind = EngineKind.TRANSFORMERS
    urls: tuple[str, ...] = ()  # the SGLang servers; an engine the job runs takes none
    weight_sync: WeightSync = WeightSync.TENSOR
    # How SGLang servers hold generation around an update; None: retract (the RL frameworks'
    # default), and for the transformers engine, which generates only inside the step, nothing.
    pause: EnginePause | None = None
    bucket_bytes: int = 1 << 20  # the most bytes of weights sent in one update call

    @property
    def served(self) -> bool:
        """Whether the engine is served apart (SGLang), reached by URL, rather than run by the job."""
        return ENGINES[self.kind].served


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Where the ranks run and how long each may take to answer (`--ray-address`, `--rank-timeout`)."""

    # A running Ray cluster's GCS address (HOST:PORT); None: a private cluster of the job's own,
    # on loopback (`orchestrator.job.ray_cluster`), or the driver's process for one rank.
    ray_address: str | None = None
    rank_timeout_s: float = RANK_TIMEOUT_S


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """A run: its shape at the top, then one section per group of the CLI's options."""

    steps: int = 30
    ranks: int = 2
    # The ranks' layout (`job.layout`): DP is what TP x PP leave of `ranks`.
    tp: int = 1
    pp: int = 1
    ep: int = 1
    mode: Mode = Mode.REMATERIALIZE
    # Which of grad_buffer, default leave the device for the rollout (orchestrator/core/offload.py).
    # `auto` decides from the measured budget on GPUs (`job.memory`); on the CPU it moves both.
    offload: Offload = Offload.AUTO
    seed: int = 0
    device: Device = Device.CPU
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    engine: Engine = field(default_factory=Engine)
    cluster: Cluster = field(default_factory=Cluster)
    verify: Verify = field(default_factory=Verify)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)  # job/checkpoint.py

    def __post_init__(self) -> None:
        problems = [
            *_run_problems(self),
            *_layout_problems(self),
            *_engine_problems(self.engine, self.device, self.ranks),
            *_cluster_problems(self.cluster),
            *_verify_problems(self.verify),
            *checkpoint_problems(self.checkpoint),
        ]
        if problems:
            raise ConfigError(problems)

    @property
    def layout(self) -> Parallelism:
        """The ranks' layout as the planner reads it: TP x PP x DP, with EP."""
        return run_layout(ranks=self.ranks, tp=self.tp, pp=self.pp, ep=self.ep)


def _run_problems(config: RunConfig) -> list[str]:
    problems = []
    if config.steps < 1:
        problems.append(f"--steps must be at least 1, got {config.steps}")
    if config.ranks < 1:
        problems.append(f"--ranks must be at least 1, got {config.ranks}")
    if config.mode not in (Mode.REMATERIALIZE, Mode.BACKUP):
        problems.append(f"--mode must be rematerialize or backup, got {config.mode!r}")
    if config.offload not in Offload.__members__.values():
        problems.append(f"--offload must be one of {', '.join(Offload)}, got {config.offload!r}")
    rows = config.grpo.prompts_per_step * config.grpo.group_size
    dp = config.layout.dp
    if config.ranks >= 1 and rows % dp:
        over = f"{config.ranks} ranks" if dp == config.ranks else f"{dp} data-parallel groups"
        problems.append(f"the {rows} samples of a step do not split evenly over {over}")
    if not 0 <= config.seed <= SEED_MAX:
        problems.append(f"--seed must be >= 0 and < 2**64 (torch's generator takes 64 bits), got {config.seed}")
    return problems


def _layout_problems(config: RunConfig) -> list[str]:
    """The layout against the model (`job.layout`), and what the run's weight syncs cannot yet
    do at it: SGLang's pushes read every weight on rank 0, or on every rank, with no gather."""
    if config.ranks < 1:
        return []  # named by _run_problems
    model = config.grpo.model
    layout = config.layout
    problems = layout_problems(layout, model.shape(), ranks=config.ranks, vocab_size=model.vocab_size)
    if not problems and model_parallel(layout) and config.engine.served:
        problems.append(
            f"{given_sizes(layout)}: --engine sglang takes data parallelism only in colocate run yet (its "
            "pushes do not gather shards); colocate_megatron syncs any layout to SGLang"
        )
    return problems


def _engine_problems(engine: Engine, device: Device, ranks: int) -> list[str]:
    """An engine served apart (SGLang) is reached by URL; one the job runs takes none."""
    problems = []
    if engine.served:
        problems += url_problems(
            engine.urls, label="--engine-url", missing="--engine sglang needs at least one --engine-url"
        )
    elif engine.urls:
        problems.append(f"--engine-url is for --engine sglang; the {engine.kind} engine runs in this job")
    if engine.pause not in (None, EnginePause.NONE) and not engine.served:
        problems.append(
            f"--engine-pause {engine.pause} is for --engine sglang; the {engine.kind} engine generates "
            "only inside the step, never during an update"
        )
    if engine.weight_sync is WeightSync.BROADCAST and not engine.served:
        problems.append("--weight-sync broadcast is for --engine sglang, to servers off the trainer's GPUs")
    if device is Device.CUDA and ranks > 1 and engine.served:
        problems.append("--device cuda --ranks N > 1 runs the transformers engine (a replica per GPU), not sglang")
    if engine.bucket_bytes < 1:
        problems.append(f"bucket size must be positive, got {engine.bucket_bytes}")
    return problems


def _cluster_problems(cluster: Cluster) -> list[str]:
    problems = address_problems(cluster.ray_address) if cluster.ray_address is not None else []
    timeout = cluster.rank_timeout_s
    if not (math.isfinite(timeout) and 0 < timeout <= RANK_TIMEOUT_MAX_S):
        problems.append(
            f"--rank-timeout must be a positive number of seconds, at most {RANK_TIMEOUT_MAX_S:.0f} (a week), "
            f"got {timeout}"
        )
    return problems


def _verify_problems(verify: Verify) -> list[str]:
    return [f"--verify-cycles must be >= 0, got {verify.cycles}"] if verify.cycles < 0 else []


def checkpoint_problems(checkpoint: Checkpoint) -> list[str]:
    """The save and resume options' own problems (a resume's checkpoint is read by
    `job.checkpoint.resume_point`; whether `--save-dir` is a folder, by `job.preflight`)."""
    problems = []
    if checkpoint.save_every < 0:
        problems.append(f"--save-every must be >= 0 (0: never), got {checkpoint.save_every}")
    if checkpoint.save_every > 0 and checkpoint.save_dir is None:
        problems.append("--save-every needs --save-dir: where the checkpoints go")
    if checkpoint.state is not None:
        problems.append("checkpoint state= is the embedding's (colocate_megatron); colocate run saves its own")
    return problems
