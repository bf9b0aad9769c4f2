"""How often the driver asks each worker what is true, per event, under Ray (two ranks, one
replica): each component answers one `state()` call, asked only where an event's guards or
action read it, and asked again only after a call that changed it whose effect the span reports
(what the step's optimizer, the stash and the pauses moved; the version the push left served)."""

from __future__ import annotations

import collections
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("transformers")

from orchestrator.job.job import ColocatedJob, RunConfig
from orchestrator.job.workers import pool
from orchestrator.telemetry.listeners import Listener, TransitionRecord
from states import CYCLE

pytestmark = pytest.mark.slow

# state() calls per worker for each event of the cycle: one before the guards, one after where
# the span reports what the action changed.
ASKED = {
    "train": {"rank": 2, "engine": 0},  # the mains the step moved
    "pause_grads": {"rank": 2, "engine": 0},  # what the stash and the pauses pinned
    "update_weights": {"rank": 1, "engine": 2},  # the version the push left served
    "drop_params": {"rank": 1, "engine": 0},
    "rollout": {"rank": 1, "engine": 1},
    "restore": {"rank": 2, "engine": 1},  # what stays pinned back in TRAIN
}
STEPS = 2


class Marks(Listener):
    def __init__(self) -> None:
        self.event: str | None = None

    def on_begin(self, record: TransitionRecord) -> None:
        self.event = record.event.value

    def on_transition(self, record: TransitionRecord) -> None:
        self.event = None


def test_each_worker_is_asked_once_per_event_and_again_only_for_what_the_span_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marks = Marks()
    asked: collections.Counter[tuple[str, str, int]] = collections.Counter()
    call = pool.WorkerPool._call

    def counted(self: pool.WorkerPool[Any], targets: list[int], method: str, *rest: Any) -> list[Any]:
        if method == "state" and marks.event is not None:
            asked.update((marks.event, self.label, t) for t in targets)
        return call(self, targets, method, *rest)

    monkeypatch.setattr(pool.WorkerPool, "_call", counted)
    with ColocatedJob(RunConfig(steps=STEPS, ranks=2), listeners=[marks]) as job:
        assert job.trainer.ranks.remote and job.engine.replicas.remote, "the workers are Ray actors"
        for _ in range(STEPS):
            job.run_step()
    seen = {
        row.event.value: {
            label: max(asked[(row.event.value, label, w)] for w in range(workers)) / STEPS
            for label, workers in (("rank", 2), ("engine", 1))
        }
        for row in CYCLE
    }
    print("state() calls per worker per event:", seen)
    assert seen == ASKED
