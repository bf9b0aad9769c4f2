"""The main job: a colocated GRPO loop on the embedded CPU default, driven by the lifecycle.

Every step walks the whole cycle through the controller, and nothing else moves memory:

    pause_grads → update_weights → drop_params → rollout → restore → train

The trainer is real Megatron-core (DDP + DistributedOptimizer over gloo), the engine is a real
Hugging Face Llama that receives the trained weights each step, and the policy learns a small
verifiable task, which it could not if the weights did not arrive.

On GPUs (`device="cuda"`) each rank trains on a GPU of its own over NCCL, with torch_memory_saver
regions. With several ranks, each is a Ray actor holding a whole GPU's bundle, beside an engine
replica (the same Llama) in a process of its own on that GPU, which receives its rank's weights
by CUDA IPC; a rollout is split between the replicas. With one rank, the engine is either the
same Llama on that GPU or running SGLang servers (`engine="sglang"`, one URL
each), which receive the weights by CUDA IPC from the rank's own memory, or, off the trainer's
GPUs (`weight_sync="broadcast"`), over a process group rank 0 hosts.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from opentelemetry import trace

from orchestrator.core.config import Device, EngineKind, LifecycleConfig, WeightSync
from orchestrator.core.lifecycle import Lifecycle
from orchestrator.demo.grpo import GRPOConfig, SyntheticTask, group_advantages
from orchestrator.demo.ray_cluster import address_problems, driver_ip
from orchestrator.demo.report import DeviceMemoryListener, ReportListener, RunReport
from orchestrator.demo.workers.engine_replica import EngineReplica
from orchestrator.demo.workers.fanout import BroadcastPush, DistributedTrainer, RankZeroPush, ReplicaIpcPush, ReplicaSet
from orchestrator.demo.workers.placement import RayPlacement
from orchestrator.demo.workers.pool import RANK_TIMEOUT_S, WorkerPool
from orchestrator.demo.workers.trainer_rank import Batch, TrainerRank
from orchestrator.errors import ConfigError
from orchestrator.protocols import JobEngine, WeightTransport
from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import Listener
from orchestrator.telemetry.tracing import exporters_requested
from states import Mode, Phase


def url_problems(urls: Sequence[str]) -> list[str]:
    """What is wrong with a list of server URLs: none, not http(s), or one given twice."""
    if not urls:
        return ["--engine sglang needs at least one --engine-url"]
    problems = [
        f"--engine-url {url!r}: not an http:// or https:// URL"
        for url in urls
        if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1].strip("/")
    ]
    names = [url.rstrip("/") for url in urls]
    return problems + [f"--engine-url {url} given twice" for url in sorted({u for u in names if names.count(u) > 1})]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    steps: int = 30
    ranks: int = 2
    mode: Mode = Mode.REMATERIALIZE
    verify_cycles: int = 2
    seed: int = 0
    bucket_bytes: int = 1 << 20
    rank_timeout_s: float = RANK_TIMEOUT_S
    device: Device = Device.CPU
    engine: EngineKind = EngineKind.TRANSFORMERS
    engine_urls: tuple[str, ...] = ()
    weight_sync: WeightSync = WeightSync.TENSOR
    # A running Ray cluster's GCS address (HOST:PORT) to run the ranks on; None: a private cluster
    # of the job's own, on loopback (`orchestrator.demo.ray_cluster`).
    ray_address: str | None = None
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        problems = []
        if self.engine is EngineKind.SGLANG:
            problems += url_problems(self.engine_urls)
        if self.engine is EngineKind.TRANSFORMERS and self.engine_urls:
            problems.append("--engine-url is for --engine sglang; the transformers engine runs in this job")
        if self.engine is EngineKind.TRANSFORMERS and self.weight_sync is WeightSync.BROADCAST:
            problems.append("--weight-sync broadcast is for --engine sglang")
        if self.device is Device.CUDA and not torch.cuda.is_available():
            problems.append("--device cuda: no CUDA device is visible to this process")
        if self.device is Device.CUDA and torch.cuda.is_available() and self.ranks > torch.cuda.device_count():
            problems.append(
                f"--device cuda --ranks {self.ranks}: one rank per GPU, and {torch.cuda.device_count()} GPU(s) are visible"
            )
        if self.device is Device.CUDA and self.ranks > 1 and self.engine is EngineKind.SGLANG:
            problems.append("--device cuda --ranks N > 1 runs the transformers engine (a replica per GPU), not sglang")
        if self.ray_address is not None:
            problems += address_problems(self.ray_address)
        if self.steps < 1:
            problems.append(f"--steps must be at least 1, got {self.steps}")
        if self.ranks < 1:
            problems.append(f"--ranks must be at least 1, got {self.ranks}")
        if self.mode not in (Mode.REMATERIALIZE, Mode.BACKUP):
            problems.append(f"--mode must be rematerialize or backup, got {self.mode!r}")
        if self.verify_cycles < 0:
            problems.append(f"--verify-cycles must be >= 0, got {self.verify_cycles}")
        if self.ranks >= 1 and self.grpo.prompts_per_step * self.grpo.group_size % self.ranks:
            rows = self.grpo.prompts_per_step * self.grpo.group_size
            problems.append(f"the {rows} samples of a step do not split evenly over {self.ranks} ranks")
        if not (math.isfinite(self.rank_timeout_s) and self.rank_timeout_s > 0):
            problems.append(f"--rank-timeout must be a positive number of seconds, got {self.rank_timeout_s}")
        if self.seed < 0:
            problems.append(f"--seed must be >= 0, got {self.seed}")
        if self.bucket_bytes < 1:
            problems.append(f"bucket size must be positive, got {self.bucket_bytes}")
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    step: int
    reward_mean: float
    loss: float
    engine_matches_trainer: bool | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous_store(host: str = "127.0.0.1") -> torch.distributed.TCPStore:
    """The ranks' rendezvous store, bound by the driver to `host` and a port the system picks, and
    held for the job's life: the port is taken before any rank hears of it, so nothing can race
    for it. The socket is bound here and handed over because the store's own server would listen
    on every interface, whatever host it is given."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family)
    port = int(listener.getsockname()[1])
    return torch.distributed.TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
    )


class ColocatedJob:
    """Builds the ranks, the engine and the lifecycle; `run_step()` runs one full cycle."""

    def __init__(self, config: RunConfig, listeners: Sequence[Listener] = (), trace_dir: Path | None = None) -> None:
        self.config = config
        self.trace_dir = trace_dir  # where rank and engine processes write their spans
        self.task = SyntheticTask(config.grpo.task)
        self._generator = torch.Generator().manual_seed(config.seed)
        self._close_engine: Callable[[], None] = lambda: None
        self._ray: RayPlacement | None = None  # with --ranks > 1: Ray and the actors it placed
        self._local_workers: list[TrainerRank] = []  # ranks in this process (--ranks 1)
        self._broadcast = config.weight_sync is WeightSync.BROADCAST
        self._store_host = driver_ip(config.ray_address)
        self._store: torch.distributed.TCPStore | None = rendezvous_store(self._store_host)
        self._port = int(self._store.port)
        try:
            # One trace for the start-up, so the engine's first release has a parent.
            with trace.get_tracer(semconv.TRACER).start_as_current_span(semconv.START_SPAN):
                self._build(listeners)
        except BaseException:
            self.close()  # a job that never started leaves no Ray, actors or folders behind
            raise
        self._step = 0

    def _build(self, listeners: Sequence[Listener]) -> None:
        config = self.config
        ranks, self.engine = self._start()
        self.trainer = DistributedTrainer(ranks)
        self.report = RunReport(mode=config.mode.value, ranks=config.ranks)
        if config.device is Device.CUDA:
            self.report.gpu_total_bytes = [total for _, total in self.trainer.device_memory()]
            listeners = [DeviceMemoryListener(self.report, self.trainer), *listeners]
        # The config guards judge the Megatron flags the ranks really built with.
        lifecycle_config = LifecycleConfig(
            mode=config.mode, verify_cycles=config.verify_cycles, setup=self.trainer.setup()
        )
        self.lifecycle = Lifecycle(
            config=lifecycle_config,
            trainer=self.trainer,
            regions=self.trainer,
            engine=self.engine,
            transport=self._transport(ranks),
            listeners=[ReportListener(self.report), *listeners],
        )
        layout = self.lifecycle.snapshot().layout
        self.report.param_bytes_bf16_per_rank = layout.param_bytes

    def _transport(self, ranks: WorkerPool[TrainerRank]) -> WeightTransport:
        bucket = self.config.bucket_bytes
        if self._broadcast:
            return BroadcastPush(ranks, bucket)
        if isinstance(self.engine, ReplicaSet) and len(self.engine.replicas) > 1:
            return ReplicaIpcPush(ranks, self.engine, bucket)
        return RankZeroPush(ranks, self.engine, bucket)

    def _trace_file(self, role: str) -> str | None:
        return str(self.trace_dir / f"{role}.otlp.jsonl") if self.trace_dir is not None else None

    def _start(self) -> tuple[WorkerPool[TrainerRank], JobEngine]:
        cfg, grpo = self.config, self.config.grpo
        if cfg.device is Device.CPU:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # this process and its Ray actors: ranks never see a GPU
        sglang = None
        if cfg.engine is EngineKind.SGLANG:
            try:
                from orchestrator.adapters.engines.sglang import SGLangGroup
            except ImportError as exc:
                raise ConfigError(
                    [f"--engine sglang needs the sglang extra (pip install -e '.[sglang]'): {exc}"]
                ) from exc

            # Before any rank starts: an unreachable server fails the run at once, by its URL.
            sglang = SGLangGroup(cfg.engine_urls, read_timeout_s=cfg.rank_timeout_s)
            self._close_engine = sglang.close
            sglang.connect()
        port = self._port
        if cfg.ranks == 1 and cfg.ray_address is None:
            # One process: the driver's tracer provider serves the rank and the engine too.
            threads = torch.get_num_threads()
            worker = TrainerRank(0, 1, port, grpo.model, grpo.clip_eps, threads=threads, device=cfg.device)
            self._local_workers.append(worker)
            ranks: WorkerPool[TrainerRank] = WorkerPool([worker], label="rank", remote=False)
            engine = sglang or self._local_engine()
        else:
            self._ray = RayPlacement(
                ranks=cfg.ranks, cuda=cfg.device is Device.CUDA, engine_bundle=sglang is None,
                timeout=cfg.rank_timeout_s, trace_file=self._trace_file,
                address=cfg.ray_address, store_host=self._store_host,
            )  # fmt: skip
            ranks = self._ray.start_ranks(port, grpo.model, grpo.clip_eps)
            engine = sglang or self._ray.start_engine(
                grpo.model, rows=grpo.prompts_per_step * grpo.group_size, max_len=grpo.max_len
            )
        if self._broadcast and sglang is not None:  # rank 0 hosts the servers' weight-update group
            tp_sizes = [e.tp_size for e in sglang.engines]
            ranks.one(0, TrainerRank.join_weight_group, list(cfg.engine_urls), tp_sizes, _free_port())
        return ranks, engine

    def _local_engine(self) -> ReplicaSet:
        """The transformers engine in this process (`--ranks 1`)."""
        grpo = self.config.grpo
        rows = grpo.prompts_per_step * grpo.group_size
        replica = EngineReplica(grpo.model, max_batch=rows, max_len=grpo.max_len)
        return ReplicaSet(WorkerPool([replica], label="engine", remote=False))

    def run_step(self) -> StepOutcome:
        """One colocated step: sync the trained weights, roll out, restore, train on the rollout."""
        lc = self.lifecycle
        self._step += 1
        with lc.step(self._step), self._fault_on_error():
            lc.pause_grads()
            lc.update_weights()
            with trace.get_tracer(semconv.TRACER).start_as_current_span(semconv.ENGINE_MATCHES_TRAINER_SPAN) as span:
                matches = self.engine_matches_trainer()
                if matches is not None:
                    span.set_attribute(semconv.ENGINE_MATCHES_TRAINER, matches)
            lc.drop_params()
            batch, reward = lc.rollout(self._rollout)
            lc.restore()
            loss = lc.train(lambda: self.trainer.train(batch))
            pinned = self.trainer.host_pinned_bytes()
        current = self.report.steps[-1]
        current.reward_mean, current.loss, current.engine_matches_trainer = reward, loss, matches
        if matches is not None:
            self.report.engine_matches_trainer = self.report.engine_matches_trainer is not False and matches
        self.report.host_pinned_bytes_per_rank = pinned
        return StepOutcome(self._step, reward, loss, matches)

    @contextlib.contextmanager
    def _fault_on_error(self) -> Iterator[None]:
        """A failure anywhere in a step, between transitions too (the digest comparison, a query),
        leaves the lifecycle FAULTED with its cause; an action's own failure already has."""
        try:
            yield
        except Exception as exc:
            if self.lifecycle.phase is not Phase.FAULTED:
                self.lifecycle.fault(exc)
            raise

    def engine_matches_trainer(self) -> bool | None:
        """The engine's weights, digest for digest, against rank 0's converted weights (None: the
        engine cannot report its weights, so nothing was compared)."""
        engine = self.engine.digests()
        if engine is None:
            return None
        return bool(engine == self.trainer.converted_digests())

    def _rollout(self) -> tuple[Batch, float]:
        grpo = self.config.grpo
        prompts = self.task.prompts(grpo.prompts_per_step, self._generator).repeat_interleave(grpo.group_size, 0)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self._generator))
        completions, logprobs = self.engine.generate(
            prompts, max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature, seed=seed
        )
        rewards = self.task.rewards(prompts, completions)
        advantages = group_advantages(rewards, grpo.group_size)
        return Batch(prompts, completions, logprobs, advantages), float(rewards.mean())

    def close(self) -> None:
        """End the actors (their spans flushed first), Ray, the in-process ranks, the SGLang
        connections and the rendezvous store, whatever state they are in."""
        try:
            if self._ray is not None:
                self._ray.close(flush=self.trace_dir is not None or bool(exporters_requested()))
        finally:
            self._ray = None
            for worker in self._local_workers:
                worker.close()
            self._local_workers = []
            self._close_engine()
            self._store = None  # the port goes back once no rank needs it
