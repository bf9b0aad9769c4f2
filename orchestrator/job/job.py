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

The engine is chosen by name in `orchestrator.adapters.registry.ENGINES`, the weight sync in
`workers.transports.WEIGHT_SYNCS`; where the workers run (this process, or Ray actors) in `workers.placement`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from opentelemetry import trace
from opentelemetry.context import Context

from orchestrator.adapters.registry import ENGINES, EngineSpec
from orchestrator.core.config import Device, EnginePause, LifecycleConfig
from orchestrator.core.lifecycle import Lifecycle
from orchestrator.job import interrupt
from orchestrator.job.checkpoint import JobCheckpointer, ResumePoint, resume_point
from orchestrator.job.config import RunConfig
from orchestrator.job.grpo import SyntheticTask, group_advantages
from orchestrator.job.layout import describe as layout
from orchestrator.job.memory import MeasuredMemory
from orchestrator.job.models import describe
from orchestrator.job.ray_cluster import driver_ip
from orchestrator.job.report import DeviceMemoryListener, ReportListener, RunReport
from orchestrator.job.workers.facades import DistributedTrainer, ReplicaSet
from orchestrator.job.workers.placement import LocalPlacement, Placement, RayPlacement, in_process
from orchestrator.job.workers.trainer_rank import Batch
from orchestrator.job.workers.transports import WEIGHT_SYNCS
from orchestrator.protocols import RolloutEngine
from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import Listener
from orchestrator.telemetry.tracing import exporters_requested
from states import Phase

if TYPE_CHECKING:
    from orchestrator.job.workers.pool import WorkerPool
    from orchestrator.job.workers.trainer_rank import TrainerRank


@dataclass(frozen=True, slots=True)
class StepOutcome:
    step: int
    reward_mean: float
    loss: float
    engine_matches_trainer: bool | None


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


def _report(config: RunConfig) -> RunReport:
    """The run's report, before its first step: what it trains, and on what layout."""
    grpo = config.grpo
    rows = grpo.prompts_per_step * grpo.group_size
    micro = (
        f", {grpo.micro_batch} rows a forward and backward" if 0 < grpo.micro_batch < rows // config.layout.dp else ""
    )
    return RunReport(
        mode=config.mode.value,
        ranks=config.ranks,
        model=describe(grpo.model),
        layout=layout(config.layout),
        learning=f"lr {grpo.lr:g}, {grpo.prompts_per_step} prompts x {grpo.group_size} samples a step{micro}",
    )


def _part(name: str) -> contextlib.AbstractContextManager[object]:
    """One part of the start-up, as a child span of `colocate.start`."""
    return trace.get_tracer(semconv.TRACER).start_as_current_span(name)


class ColocatedJob:
    """The ranks, the engine and the lifecycle of a run; `run_step()` runs one full cycle.

        with ColocatedJob(config, listeners) as job:
            for _ in range(config.steps):
                job.run_step()

    Nothing starts before `start()` (which `with` calls); `close()` ends whatever was started,
    whatever state it is in, and a start that fails ends what it had started before it raises.
    `trace_dir`: where the rank and engine processes write their spans. Once `stop` is set
    (Ctrl-C), `start()` ends within moments by KeyboardInterrupt.
    """

    def __init__(
        self,
        config: RunConfig,
        listeners: Sequence[Listener] = (),
        trace_dir: Path | None = None,
        stop: threading.Event | None = None,
        resumed: ResumePoint | None = None,
    ) -> None:
        self.config, self.listeners, self.trace_dir, self.stop = config, tuple(listeners), trace_dir, stop
        self.resumed = resumed  # verified up front (the CLI); else `start` reads config.checkpoint.resume
        self.task = SyntheticTask(config.grpo.task)
        self.report = _report(config)
        self._generator, self._step = torch.Generator().manual_seed(config.seed), 0
        self._started, self._closable = contextlib.ExitStack(), False  # what `start` acquired; until `close`
        self._lifecycle: Lifecycle | None = None
        self._store: torch.distributed.TCPStore | None = None  # the ranks' rendezvous, held while they run

    def __enter__(self) -> ColocatedJob:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def lifecycle(self) -> Lifecycle:
        if self._lifecycle is None:
            raise RuntimeError("the job has not started: `with ColocatedJob(...) as job`, or job.start()")
        return self._lifecycle

    @property
    def phase(self) -> str:
        """The lifecycle's phase, or "start-up" before there is a lifecycle."""
        return "start-up" if self._lifecycle is None else str(self._lifecycle.phase)

    def start(self) -> None:
        """Connect to a served engine, start the ranks (and the engine the job runs), build the lifecycle."""
        self._closable = True
        try:
            # One trace for the start-up, so the engine's first release has a parent.
            with trace.get_tracer(semconv.TRACER).start_as_current_span(semconv.START_SPAN):
                self._start()
        except BaseException:
            self.close()  # a job that never started leaves no Ray, actors or folders behind
            raise

    def _start(self) -> None:
        cfg, grpo = self.config, self.config.grpo
        if cfg.checkpoint.resume is not None and self.resumed is None:  # before anything starts: refused, nothing lost
            self.resumed = resume_point(cfg)
        adapter = ENGINES[cfg.engine.kind]
        spec = EngineSpec(
            model=grpo.model, max_batch=grpo.prompts_per_step * grpo.group_size, max_len=grpo.max_len,
            device=cfg.device.value, urls=cfg.engine.urls, timeout_s=cfg.cluster.rank_timeout_s,
            pause=cfg.engine.pause or EnginePause.RETRACT,
        )  # fmt: skip
        # Before any rank starts: an unreachable server fails the run at once, by its URL.
        with _part(semconv.START_CONNECT_SPAN):
            served = self._started.enter_context(adapter.build(spec)) if adapter.served else None
        with _part(semconv.START_CLUSTER_SPAN):
            store_host = driver_ip(cfg.cluster.ray_address)
            self._store = rendezvous_store(store_host)
            self._started.callback(setattr, self, "_store", None)  # the port goes back once no rank needs it
            placement = self._place(store_host, engine_bundle=served is None)
            self._started.callback(placement.close, flush=self.trace_dir is not None or bool(exporters_requested()))
        with _part(semconv.START_RANKS_SPAN):
            ranks = placement.start_ranks(int(self._store.port), grpo.model, grpo.train_step, cfg.verify.digest,
                                          tp=cfg.tp, ep=cfg.ep)  # fmt: skip
        interrupt.check(self.stop)  # ranks built in this process do not look at it
        if self.resumed is not None:
            with _part(semconv.RESUME_SPAN):
                self._step = self.resumed.load(DistributedTrainer(ranks), self._generator, self.report, cfg.ranks)
        with _part(semconv.START_ENGINE_SPAN):
            self.engine: RolloutEngine = served if served is not None else placement.start_engine(cfg.engine.kind, spec)
        interrupt.check(self.stop)
        self.trainer = DistributedTrainer(ranks)
        listeners = [ReportListener(self.report), *self.listeners]
        if cfg.device is Device.CUDA:  # the report shows each GPU's free memory per phase
            self.report.gpu_total_bytes = [total for _, total in self.trainer.device_memory()]
            listeners.insert(1, DeviceMemoryListener(self.report, self.trainer))
        # The config guards judge the Megatron flags the ranks really built with.
        with _part(semconv.START_LIFECYCLE_SPAN):
            self._lifecycle = self._build_lifecycle(ranks, listeners)
        self.report.built(self._lifecycle.snapshot().layout)

    def _build_lifecycle(self, ranks: WorkerPool[TrainerRank], listeners: list[Listener]) -> Lifecycle:
        cfg = self.config
        setup = self.trainer.setup()
        return Lifecycle(
            config=LifecycleConfig(
                mode=cfg.mode, verify_cycles=cfg.verify.cycles, setup=setup, offload=cfg.offload, memory=self._memory()
            ),
            trainer=self.trainer,
            regions=self.trainer,
            engine=self.engine,
            transport=WEIGHT_SYNCS[cfg.engine.weight_sync](ranks, self.engine, cfg.engine.bucket_bytes),
            listeners=listeners,
            checkpointer=JobCheckpointer.of(cfg, self.trainer, self._generator, self.report),
            resumed_version=self.resumed.weight_version if self.resumed is not None else 0,
        )

    def _memory(self) -> MeasuredMemory | None:
        """On GPUs, with an engine that knows its footprint, the measured budget the memory guard
        and `--offload auto` read; else none: nothing is checked, and `auto` moves what `always` does."""
        if self.config.device is not Device.CUDA or not isinstance(self.engine, ReplicaSet):
            return None
        footprint = self.engine.footprint()
        return None if footprint is None else MeasuredMemory(self.trainer, footprint)

    def _place(self, store_host: str, *, engine_bundle: bool) -> Placement:
        """The driver's own process where it can hold the job (one rank, on the device it has);
        else Ray: a private cluster, or the one at `--ray-address`."""
        cfg = self.config
        if in_process(ranks=cfg.ranks, device=cfg.device.value, address=cfg.cluster.ray_address):
            return LocalPlacement(device=cfg.device.value)
        return RayPlacement(
            ranks=cfg.ranks, cuda=cfg.device is Device.CUDA, engine_bundle=engine_bundle,
            timeout=cfg.cluster.rank_timeout_s, trace_file=self._trace_file, address=cfg.cluster.ray_address, store_host=store_host,
            stop=self.stop,
        )  # fmt: skip

    def _trace_file(self, role: str) -> str | None:
        return str(self.trace_dir / f"{role}.otlp.jsonl") if self.trace_dir is not None else None

    def run_step(self) -> StepOutcome:
        """One colocated step: sync the trained weights, roll out, restore, train on the rollout."""
        lc = self.lifecycle
        self._step += 1
        with lc.step(self._step), self._fault_on_error():
            lc.pause_grads()
            lc.update_weights()
            matches = self._checked_engine()
            lc.drop_params()
            batch, reward = lc.rollout(self._rollout)
            lc.restore()
            loss = lc.train(lambda: self.trainer.train(batch))
            # In the step: a checkpoint saved at its end holds the step whole.
            current = self.report.steps[-1]
            current.reward_mean, current.loss, current.engine_matches_trainer = reward, loss, matches
            if matches is not None:
                self.report.engine_matches_trainer = self.report.engine_matches_trainer is not False and matches
        return StepOutcome(self._step, reward, loss, matches)

    @property
    def steps_begun(self) -> int:  # those before a resume too: once started, where the run continues
        return self._step

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

    def _checked_engine(self) -> bool | None:
        """The engine's weights, digest for digest, against rank 0's converted weights, in a span of
        that name which always says true or false; no span and None where the engine cannot report them."""
        if not self.engine.features.reports_weights:
            return None
        with trace.get_tracer(semconv.TRACER).start_as_current_span(semconv.ENGINE_MATCHES_TRAINER_SPAN) as span:
            engine = self.engine.digests()
            matches = None if engine is None else bool(engine == self.trainer.converted_digests())
            if matches is not None:
                span.set_attribute(semconv.ENGINE_MATCHES_TRAINER, matches)
            return matches

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
        """End what `start` started, whatever state it is in, once, in a trace of its own (`_release`);
        the first failure is raised once every one has been tried."""
        if self._closable:
            self._closable = False
            _release(self._started)


def _release(started: contextlib.ExitStack) -> None:
    """What `start` acquired (the actors, their spans flushed first, Ray, the in-process ranks, the
    engine's connections, the rendezvous store), released in reverse order in one trace,
    `colocate.close`: a root, whatever is current (a step's span a failure left open is not its parent)."""
    with trace.get_tracer(semconv.TRACER).start_as_current_span(semconv.CLOSE_SPAN, context=Context()):
        started.close()
