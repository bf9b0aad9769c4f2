"""A small world for the model check: the controller over in-memory adapters, each adapter call
counted (so an exception can be injected at any one of them) and watched for the hazards of the
design brief §1 (a hazard is recorded when the call is made, whether or not the fake would crash).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator import Lifecycle, LifecycleConfig
from orchestrator.protocols import TransferReport
from orchestrator.testing import InMemoryEngine, InMemoryRegions, InMemoryTrainer, InMemoryTransport
from states import EngineMemory, Mode, Region


class Injected(RuntimeError):
    """The exception the model check raises inside an adapter call."""


@dataclass
class Calls:
    """Counts adapter calls; raises `Injected` at call number `fail_at`. Records hazards seen."""

    count: int = 0
    fail_at: int | None = None
    hazards: list[str] = field(default_factory=list)

    def enter(self, name: str) -> None:
        number, self.count = self.count, self.count + 1
        if number == self.fail_at:
            raise Injected(f"injected at call {number}: {name}")


def expected_params(trainer: InMemoryTrainer) -> dict[str, torch.Tensor]:
    """What the bf16 params must be whenever they are resident: the fp32 mains, cast."""
    return {name: main.to(torch.bfloat16) for name, main in trainer.mains.items()}


def same(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return all(name in tensors and torch.equal(tensors[name], t) for name, t in expected.items())


class WatchedRegions(InMemoryRegions):
    def __init__(self, calls: Calls, trainer: InMemoryTrainer) -> None:
        super().__init__({r.value: 4 for r in Region}, on_pause={Region.PARAM_BUFFER.value: trainer.drop})
        self.watch = calls

    def pause(self, tag: str) -> int:
        self.watch.enter(f"regions.pause({tag})")
        if tag in self.paused:
            self.watch.hazards.append(f"double pause of {tag}")
        return super().pause(tag)

    def resume(self, tag: str) -> int:
        self.watch.enter(f"regions.resume({tag})")
        if tag not in self.paused:
            self.watch.hazards.append(f"resume of resident {tag}")
        return super().resume(tag)


class WatchedTrainer(InMemoryTrainer):
    def attach(self, calls: Calls) -> None:
        self.watch = calls

    def stash(self, mode: Mode) -> int:
        self.watch.enter("trainer.stash")
        return super().stash(mode)

    def rebuild(self, mode: Mode) -> int:
        self.watch.enter("trainer.rebuild")
        return super().rebuild(mode)

    def digests(self) -> Any:
        self.watch.enter("trainer.digests")
        return super().digests()

    def optimizer_step(self) -> None:
        self.watch.enter("trainer.optimizer_step")
        super().optimizer_step()


class WatchedEngine(InMemoryEngine):
    def __init__(self, calls: Calls, regions: WatchedRegions) -> None:
        super().__init__()
        self.watch, self._regions = calls, regions
        self.pushed: list[int] = []

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self.watch.enter("engine.release")
        if self.busy:
            self.watch.hazards.append("release reached a busy engine")
        super().release(tags)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self.watch.enter("engine.resume")
        if EngineMemory.KV_CACHE in tags and Region.PARAM_BUFFER.value not in self._regions.paused:
            self.watch.hazards.append("engine KV resumed while the trainer's params are resident")
        super().resume(tags)

    def flush_cache(self) -> None:
        self.watch.enter("engine.flush_cache")
        super().flush_cache()

    def weight_version(self) -> int | None:
        self.watch.enter("engine.weight_version")
        return super().weight_version()

    def is_idle(self) -> bool:
        self.watch.enter("engine.is_idle")
        return super().is_idle()


class WatchedTransport(InMemoryTransport):
    def __init__(self, trainer: WatchedTrainer, engine: WatchedEngine, calls: Calls) -> None:
        super().__init__(trainer, engine)
        self.watch, self.watched = calls, engine

    def push(self, version: int) -> TransferReport:
        self.watch.enter("transport.push")
        if Region.PARAM_BUFFER.value in self.watched._regions.paused:
            self.watch.hazards.append("update_weights read a dropped param buffer")
        elif not same(self.trainer.params, expected_params(self.trainer)):
            self.watch.hazards.append("update_weights pushed params that are not the rebuilt ones")
        if EngineMemory.WEIGHTS not in self.engine.resident:
            self.watch.hazards.append("update_weights wrote into released engine weights")
        pushed = self.watched.pushed
        if pushed and version < pushed[-1]:
            self.watch.hazards.append(f"weight version went back from {pushed[-1]} to {version}")
        pushed.append(version)
        return super().push(version)


@dataclass
class World:
    lifecycle: Lifecycle
    trainer: WatchedTrainer
    engine: WatchedEngine
    regions: WatchedRegions
    calls: Calls

    def generate(self) -> int | None:
        """The rollout's work: serve, and say so if the weights served are not the synced ones."""
        self.calls.enter("engine.generate")
        engine = self.engine
        if EngineMemory.WEIGHTS not in engine.resident:
            self.calls.hazards.append("rollout ran with the engine's weights released")
        elif not same(engine.weights, expected_params(self.trainer)):
            self.calls.hazards.append("rollout served weights that are not the trainer's")
        elif engine.version != self.lifecycle.weight_version:
            self.calls.hazards.append(f"rollout served version {engine.version}, not {self.lifecycle.weight_version}")
        return engine.generate()

    def work(self, event: str) -> Callable[[], Any] | None:
        return {"train": self.trainer.optimizer_step, "rollout": self.generate}.get(event)


def build(mode: Mode, verify_cycles: int) -> World:
    calls = Calls()
    trainer = WatchedTrainer(mains={f"layer{i}.weight": torch.randn(2, 2) for i in range(2)}, extra=torch.zeros(2))
    trainer.attach(calls)
    regions = WatchedRegions(calls, trainer)
    engine = WatchedEngine(calls, regions)
    transport = WatchedTransport(trainer, engine, calls)
    config = LifecycleConfig(mode=mode, verify_cycles=verify_cycles, recover_idle_timeout_s=0.0)
    lifecycle = Lifecycle(config=config, trainer=trainer, regions=regions, engine=engine, transport=transport)
    return World(lifecycle, trainer, engine, regions, calls)
