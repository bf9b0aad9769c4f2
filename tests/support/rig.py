"""A lifecycle on the in-memory adapters (orchestrator/testing.py), and one full cycle of it."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator import Lifecycle, LifecycleConfig, Listener
from orchestrator.testing import InMemoryEngine, InMemoryRegions, InMemoryTrainer, InMemoryTransport
from states import Mode, Region


@dataclass
class Rig:
    lifecycle: Lifecycle
    trainer: InMemoryTrainer
    engine: InMemoryEngine
    regions: InMemoryRegions
    transport: InMemoryTransport


def make_rig(
    mode: Mode = Mode.REMATERIALIZE,
    listeners: tuple[Listener, ...] = (),
    trainer: InMemoryTrainer | None = None,
    regions: InMemoryRegions | None = None,
    **config: object,
) -> Rig:
    trainer = trainer or InMemoryTrainer()
    engine = InMemoryEngine()
    regions = regions or InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop})
    transport = InMemoryTransport(trainer, engine)
    lifecycle = Lifecycle(
        config=LifecycleConfig(mode=mode, **config),  # type: ignore[arg-type]
        trainer=trainer,
        regions=regions,
        engine=engine,
        transport=transport,
        listeners=listeners,
    )
    return Rig(lifecycle, trainer, engine, regions, transport)


def to_rollout(rig: Rig) -> None:
    """The cycle up to the rollout: sync, drop, roll out."""
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    lc.rollout()


def cycle(rig: Rig) -> None:
    """One full step: sync, drop, rollout, restore, train."""
    lc = rig.lifecycle
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    lc.rollout()
    lc.restore()
    lc.train(rig.trainer.optimizer_step)
