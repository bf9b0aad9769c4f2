"""`DeviceMemoryListener`: each GPU's free bytes on entering each phase, and no question asked of
the ranks on the way into FAULTED (one may be dead or hung)."""

from __future__ import annotations

from orchestrator.job.report import DeviceMemoryListener, ReportListener, RunReport
from orchestrator.telemetry.listeners import TransitionRecord
from states import Event, Mode, Phase


class Devices:
    def __init__(self) -> None:
        self.asked = 0

    def device_memory(self) -> list[tuple[int, int]]:
        self.asked += 1
        return [(100 + self.asked, 1000), (200 + self.asked, 1000)]


def record(event: Event, src: Phase, dst: Phase) -> TransitionRecord:
    return TransitionRecord(event=event, src=src, dst=dst, step=1, rank=0, mode=Mode.REMATERIALIZE, started_ns=0)


def test_free_bytes_per_gpu_on_entering_each_phase_and_none_asked_into_faulted() -> None:
    report, devices = RunReport(mode="rematerialize", ranks=2), Devices()
    ReportListener(report).on_step_start(1, 0)
    listener = DeviceMemoryListener(report, devices)
    listener.on_transition(record(Event.PAUSE_GRADS, Phase.TRAIN, Phase.GRADS_PAUSED))
    listener.on_transition(record(Event.FAULT, Phase.GRADS_PAUSED, Phase.FAULTED))
    assert report.steps[-1].gpu_free_bytes == {"GRADS_PAUSED": [101, 201]}
    assert devices.asked == 1
