"""The run report: built from the lifecycle's own transitions by a listener, written as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import Listener, TransitionRecord
from states import Event, Phase, TrainerLayout


@dataclass
class StepReport:
    step: int
    phases: list[str] = field(default_factory=list)
    reward_mean: float = 0.0
    weight_version: int = 0
    restore_verified: bool | None = None
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # Bytes each event copied across a link: to the host (pause_grads), into the engine
    # (update_weights), back from the host (restore; the params it rebuilds on the device are not
    # counted here, they are `colocate.bytes_rebuilt`)
    phase_bytes: dict[str, int] = field(default_factory=dict)
    loss: float | None = None
    engine_matches_trainer: bool | None = None
    bytes_freed_at_drop: int = 0
    # Pinned host bytes per rank after the events that move the trainer's state: its stash and
    # its regions' host arenas (kept from one cycle to the next, so TRAIN holds them too)
    host_pinned_bytes: dict[str, int] = field(default_factory=dict)
    # GPU runs: each GPU's free bytes (cudaMemGetInfo, in rank order) on entering each phase
    gpu_free_bytes: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class RunReport:
    mode: str
    ranks: int
    steps: list[StepReport] = field(default_factory=list)
    host_pinned_bytes_per_rank: int = 0  # the most any step held
    param_bytes_bf16_per_rank: int = 0
    params_per_rank: int = 0  # as rank 0 built them (every param at DP only; its shard at TP, EP)
    model: str = ""  # what was trained, and what was made smaller than its source (`job.models`)
    layout: str = ""  # the ranks' layout, e.g. "TP 2 x DP 1" (`job.layout.describe`)
    learning: str = ""  # how it learns: the rate, a step's rows, the micro-batches
    engine_matches_trainer: bool | None = None  # None: never compared (the engine cannot report its weights)
    trace_file: str | None = None
    error: str | None = None
    interrupted: bool = False  # stopped by Ctrl-C (SIGINT): the steps before it are kept
    gpu_total_bytes: list[int] = field(default_factory=list)  # GPU runs: each rank's GPU, in rank order
    # Where the run resumed: one "step N from PATH" per resume, oldest first
    resumed: list[str] = field(default_factory=list)
    resume_seconds: float | None = None  # the last resume's: verify the checkpoint and load every rank
    # Runs that save or resume: of the engine-side (HF) weights, once every step is done
    weights_sha256: str | None = None
    # Spans the driver's OTLP exporter could not deliver (docs/tracing.md); the rank and engine
    # processes export on their own and are not counted here
    spans_dropped: int = 0

    def built(self, layout: TrainerLayout) -> None:
        """What each rank built: its params, and their bf16 bytes."""
        self.param_bytes_bf16_per_rank, self.params_per_rank = layout.param_bytes, layout.params

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> RunReport:
        """A report as `to_json` wrote it (a checkpoint's report so far)."""
        fields = dict(saved)
        fields["steps"] = [StepReport(**step) for step in saved["steps"]]
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def write(self, path: Path) -> None:
        path.write_text(self.to_json() + "\n")


_COPIED = {
    Event.PAUSE_GRADS: (semconv.BYTES_TO_HOST,),
    Event.UPDATE_WEIGHTS: (semconv.BYTES_MOVED,),
    Event.RESTORE: (semconv.BYTES_FROM_HOST,),
    Event.SAVE: (semconv.BYTES_WRITTEN,),
}


class ReportListener(Listener):
    """Records, per step, the phases visited in order and the seconds each event took.

    `phases` starts with the phase the step began in and adds each new phase entered, so a full
    step reads the phases of `states.CYCLE` in order, from TRAIN back to TRAIN.
    """

    def __init__(self, report: RunReport) -> None:
        self.report = report

    @property
    def current(self) -> StepReport:
        return self.report.steps[-1]

    def on_step_start(self, step: int, rank: int) -> None:
        self.report.steps.append(StepReport(step=step))

    def on_transition(self, record: TransitionRecord) -> None:
        if not self.report.steps:
            return
        step = self.current
        if not step.phases:
            step.phases.append(record.src.value)
        if record.dst.value != step.phases[-1]:
            step.phases.append(record.dst.value)
        step.phase_seconds[record.event.value] = round(record.seconds, 6)
        attributes: dict[str, Any] = record.attributes
        copied = [int(attributes[key]) for key in _COPIED.get(record.event, ()) if key in attributes]
        if copied:
            step.phase_bytes[record.event.value] = sum(copied)
        if (pinned := attributes.get(semconv.HOST_PINNED_BYTES)) is not None:
            step.host_pinned_bytes[record.event.value] = int(pinned)
            self.report.host_pinned_bytes_per_rank = max(self.report.host_pinned_bytes_per_rank, int(pinned))
        if record.event is Event.UPDATE_WEIGHTS:
            step.weight_version = int(attributes[semconv.WEIGHT_VERSION])
        elif record.event is Event.DROP_PARAMS:
            step.bytes_freed_at_drop = int(attributes[semconv.BYTES_FREED])
        elif record.event is Event.RESTORE:
            verified = attributes.get(semconv.RESTORE_VERIFIED)
            step.restore_verified = None if verified is None else bool(verified)


class DeviceMemory(Protocol):
    def device_memory(self) -> list[tuple[int, int]]:
        """(free, total) bytes of each rank's GPU, in rank order."""
        ...


class DeviceMemoryListener(Listener):
    """On GPUs: each GPU's free memory on entering each phase, read by the rank on that GPU
    after the transition's action, so the lifecycle's memory order can be checked per GPU."""

    def __init__(self, report: RunReport, devices: DeviceMemory) -> None:
        self.report, self.devices = report, devices

    def on_transition(self, record: TransitionRecord) -> None:
        # Not into FAULTED: a rank may be dead or hung then, and asking it would only wait out
        # the rank timeout and log a second failure beside the one the fault names.
        if self.report.steps and record.dst is not Phase.FAULTED:
            free = [f for f, _ in self.devices.device_memory()]
            self.report.steps[-1].gpu_free_bytes[record.dst.value] = free
