"""Microseconds per transition: bare `transitions` vs the full colocate controller, in one run.

The full controller admits each event through its guards, opens and ends an OpenTelemetry span
(recorded by the SDK, batched to an exporter that discards) and writes one structlog JSON line
to /dev/null through the sink `colocate run` uses (flushed per step). A last row flushes every
line instead, to show what a syscall per transition costs here. Adapters do nothing, so the
figures are the controller's own overhead.

    python benchmarks/controller_overhead.py [--cycles 2000]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from transitions import Machine

import states
from orchestrator import Lifecycle, LifecycleConfig, Listener, TransferReport
from orchestrator.protocols import EngineDefaults, RegionsStateFromReads, TrainerStateFromReads
from orchestrator.telemetry.logs import LoggingListener, configure_logging
from orchestrator.telemetry.tracing import TracingListener
from states import INITIAL, TABLE, EngineMemory, Mode, Phase, Region, Source, TrainerLayout

CYCLE = tuple(row.event.value for row in states.CYCLE)


class Discard(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class NullTrainer(TrainerStateFromReads):
    def __init__(self) -> None:
        self.generation = 0

    def optimizer_step(self) -> None:
        self.generation += 1

    def layout(self) -> TrainerLayout:
        return TrainerLayout(sync_sources={f"layer{i}.w": Source.PARAM_BUFFER for i in range(8)})

    def stash(self, mode: Mode) -> int:
        return 0

    def rebuild(self, mode: Mode) -> int:
        return 0

    def digests(self) -> dict[str, str]:
        return {}

    def sync_tensors(self) -> Iterator[tuple[str, object]]:
        return iter(())

    def host_pinned_bytes(self) -> int:
        return 0

    def mains_generation(self) -> int:
        return self.generation


class NullRegions(RegionsStateFromReads):
    """Moves no memory; keeps which tags are paused, which the controller reads before each call."""

    def __init__(self) -> None:
        self.paused: frozenset[str] = frozenset()

    def tags(self) -> frozenset[str]:
        return frozenset(r.value for r in Region)

    def pause(self, tag: str) -> int:
        self.paused |= {tag}
        return 0

    def resume(self, tag: str) -> int:
        self.paused -= {tag}
        return 0


class NullEngine(EngineDefaults):
    """Holds no memory; keeps which tags are released, which the controller reads before each call."""

    name = "null"
    version: int | None = None
    _released: frozenset[EngineMemory] = frozenset()

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self._released |= tags

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self._released -= tags

    def released(self) -> frozenset[EngineMemory]:
        return self._released

    def flush_cache(self) -> None: ...

    def weight_version(self) -> int | None:
        return self.version

    def is_idle(self) -> bool:
        return True


class NullTransport:
    def __init__(self, engine: NullEngine) -> None:
        self.engine = engine

    def push(self, version: int) -> TransferReport:
        self.engine.version = version
        return TransferReport(tensors=0, bytes=0, buckets=0)


def bare(cycles: int) -> float:
    class Model:
        pass

    model = Model()
    Machine(
        model=model,
        states=Phase,
        transitions=[{"trigger": r.event.value, "source": r.source, "dest": r.dest} for r in TABLE],
        initial=INITIAL,
        auto_transitions=False,
    )
    trigger: Callable[[str], bool] = model.trigger  # type: ignore[attr-defined]
    start = time.perf_counter()
    for _ in range(cycles):
        for event in CYCLE:
            trigger(event)
    return (time.perf_counter() - start) / (cycles * len(CYCLE)) * 1e6


def controller(cycles: int, listeners: Sequence[Listener]) -> float:
    engine, trainer = NullEngine(), NullTrainer()
    lc = Lifecycle(
        config=LifecycleConfig(mode=Mode.REMATERIALIZE, verify_cycles=0),
        trainer=trainer,
        regions=NullRegions(),
        engine=engine,
        transport=NullTransport(engine),
        listeners=listeners,
    )
    # the step's own train is the actor's optimizer step: the next update has weights to push
    steps = [partial(lc.train, trainer.optimizer_step) if event == "train" else getattr(lc, event) for event in CYCLE]
    start = time.perf_counter()
    for _ in range(cycles):
        with lc.step():
            for fire in steps:
                fire()
    return (time.perf_counter() - start) / (cycles * len(CYCLE)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=2000, help="full cycles of six transitions per variant")
    args = parser.parse_args()
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives for the whole run
    sink = configure_logging(devnull)  # what `colocate run` logs through
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard(), max_queue_size=8 * 7 * args.cycles))  # drop nothing
    full = [TracingListener(provider), LoggingListener(sink=sink)]
    flushed = [TracingListener(provider), LoggingListener(structlog.wrap_logger(structlog.WriteLogger(devnull)))]

    bare(200), controller(200, full)  # warm up imports and caches
    results = {
        "bare transitions": bare(args.cycles),
        "controller, guards only": controller(args.cycles, []),
        "controller, guards + span + log": controller(args.cycles, full),
        "  same, log flushed every line": controller(args.cycles, flushed),
    }
    provider.shutdown()
    base = results["bare transitions"]
    print(f"{'variant':<34}{'us/transition':>14}{'x bare':>9}")
    for name, micros in results.items():
        print(f"{name:<34}{micros:>14.1f}{micros / base:>9.1f}")
    full_us = results["controller, guards + span + log"]
    print(f"goal: full controller <= 100 us/transition: {'met' if full_us <= 100 else 'NOT met'} ({full_us:.1f} us)")


if __name__ == "__main__":
    main()
