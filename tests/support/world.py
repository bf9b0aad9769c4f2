"""A small world for the model check: the controller over in-memory adapters, each adapter call
counted and watched for the hazards a controller must make impossible: a double pause, a resume of a
resident region, a release of a busy engine or of released memory, the KV cache back beside resident
params, a sync from a dropped buffer, a version going back, a rollout on released or stale weights
(a hazard is recorded when the call is made, whether or not the fake would crash).

At any one call a fault can be injected (`Calls.how`):

- `before`: the call raises before it takes effect;
- `after`: it takes effect, then raises (a read timeout after the server applied it);
- `partial`: part of it takes effect, then it raises: one tag of several released or resumed,
  half the weights pushed, an optimizer step that moved the mains and wrote no params, a rebuild
  that wrote one param;
- `fault`: another party calls `Lifecycle.fault` at that moment, and the call goes on.

Two more come through a listener rather than a call (`Calls.late`, `Calls.landing`): `late`, a
fault just after an event's transition (it lands before `fire` returns), and `landing`, a fault
during the landing of another (in that landing's `on_begin`). Both are same-thread re-entries of
`Lifecycle.fault`; tests/unit/test_late_fault_race.py races them from other threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator import Lifecycle, LifecycleConfig, LifecycleError, Listener, TransitionRecord
from orchestrator.protocols import TransferReport
from orchestrator.testing import InMemoryEngine, InMemoryRegions, InMemoryTrainer, InMemoryTransport
from states import EngineMemory, Event, Mode, Region


class Injected(RuntimeError):
    """The exception the model check raises inside an adapter call."""


HOW = ("before", "after", "partial", "fault")
EFFECTS = ("regions.", "trainer.stash", "trainer.rebuild", "trainer.optimizer_step", "engine.release", "engine.resume")
EFFECTS += ("engine.flush_cache", "transport.push")
PARTIAL = ("trainer.optimizer_step", "trainer.rebuild", "transport.push")  # and release/resume of several tags


def injections(name: str) -> tuple[str, ...]:
    """The faults worth injecting at a call named `name` (a read has no effect to fail after)."""
    effect = name.startswith(EFFECTS)
    partial = name.startswith(PARTIAL) or (name.startswith(("engine.release", "engine.resume")) and "," in name)
    return ("before", "fault") + (("after",) if effect else ()) + (("partial",) if partial else ())


@dataclass
class Calls:
    """Counts adapter calls and injects `how` at call number `fail_at`. Records hazards seen and
    the calls made (`names`), so a run without injection lists where to inject."""

    count: int = 0
    fail_at: int | None = None
    how: str = "before"
    fault: Callable[[BaseException], None] | None = None  # the lifecycle's, for `fault` injections
    hazards: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    late: bool = False  # fault once, just after the next transition
    landing: bool = False  # fault once, during the next landing of a fault
    landed: bool = False  # a `landing` fault was raised

    def elsewhere(self, cause: BaseException) -> None:
        """`Lifecycle.fault` from a listener: a refusal is its answer, anything else a hazard (the
        listeners' fan-out would otherwise swallow it)."""
        assert self.fault is not None
        try:
            self.fault(cause)
        except LifecycleError:
            pass
        except Exception as exc:
            self.hazards.append(f"fault({cause}) raised {type(exc).__name__}: {exc}")

    def enter(self, name: str) -> str | None:
        """Count a call. Raises for `before`; calls `fault` for `fault`; returns `after` or
        `partial` where this call must take (part of) its effect and then raise (`Calls.leave`)."""
        number, self.count = self.count, self.count + 1
        self.names.append(name)
        if number != self.fail_at:
            return None
        if self.how == "before":
            raise Injected(f"injected before call {number}: {name}")
        if self.how == "fault":
            assert self.fault is not None
            self.fault(Injected(f"a fault from elsewhere during call {number}: {name}"))
            return None
        return self.how

    def leave(self, late: str | None, name: str) -> None:
        if late is not None:
            raise Injected(f"injected {late} call {self.count - 1}: {name}")


class FaultsMeanwhile(Listener):
    """The `late` and `landing` injections (`Calls`)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def on_transition(self, record: TransitionRecord) -> None:
        if self.calls.late and record.event is not Event.FAULT:
            self.calls.late = False
            self.calls.elsewhere(Injected(f"a fault from elsewhere just after {record.event.value}"))

    def on_begin(self, record: TransitionRecord) -> None:
        if self.calls.landing and record.event is Event.FAULT:
            self.calls.landing, self.calls.landed = False, True
            self.calls.elsewhere(Injected(f"a fault from elsewhere while {record.cause} landed"))


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
        late = self.watch.enter(name := f"regions.pause({tag})")
        if tag in self.paused:
            self.watch.hazards.append(f"double pause of {tag}")
        freed = super().pause(tag)
        self.watch.leave(late, name)
        return freed

    def resume(self, tag: str) -> int:
        late = self.watch.enter(name := f"regions.resume({tag})")
        if tag not in self.paused:
            self.watch.hazards.append(f"resume of resident {tag}")
        retaken = super().resume(tag)
        self.watch.leave(late, name)
        return retaken


class WatchedTrainer(InMemoryTrainer):
    def attach(self, calls: Calls) -> None:
        self.watch = calls
        self.truth = self.extra.clone()  # the extra as the last whole step left it: live, never dropped

    def stash(self, mode: Mode) -> int:
        late = self.watch.enter("trainer.stash")
        stashed = super().stash(mode)
        self.watch.leave(late, "trainer.stash")
        return stashed

    def rebuild(self, mode: Mode) -> int:
        late, written = self.watch.enter("trainer.rebuild"), 0
        if late == "partial":  # one param written, then the gather fails
            name = next(iter(self.params))
            self.params[name].copy_(self.mains[name])
        else:
            written = super().rebuild(mode)
        self.watch.leave(late, "trainer.rebuild")
        return written

    def digests(self) -> Any:
        self.watch.enter("trainer.digests")
        return super().digests()

    def optimizer_step(self) -> None:
        late = self.watch.enter("trainer.optimizer_step")
        if late == "partial":  # the mains moved; the params were never written
            self.move_mains()
        else:
            super().optimizer_step()
            self.truth = self.extra.clone()
        self.watch.leave(late, "trainer.optimizer_step")


class WatchedEngine(InMemoryEngine):
    def __init__(self, calls: Calls, regions: WatchedRegions) -> None:
        super().__init__()
        self.watch, self._regions = calls, regions
        self.pushed: list[int] = []

    def release(self, tags: frozenset[EngineMemory]) -> None:
        late = self.watch.enter(name := f"engine.release({','.join(sorted(tags))})")
        if self.busy:
            self.watch.hazards.append("release reached a busy engine")
        if tags - self.resident:
            self.watch.hazards.append(f"release of released {', '.join(sorted(tags - self.resident))}")
        super().release(frozenset(sorted(tags)[:1]) if late == "partial" else tags)
        self.watch.leave(late, name)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        late = self.watch.enter(name := f"engine.resume({','.join(sorted(tags))})")
        if EngineMemory.KV_CACHE in tags and Region.PARAM_BUFFER.value not in self._regions.paused:
            self.watch.hazards.append("engine KV resumed while the trainer's params are resident")
        super().resume(frozenset(sorted(tags)[:1]) if late == "partial" else tags)
        self.watch.leave(late, name)

    def flush_cache(self) -> None:
        late = self.watch.enter("engine.flush_cache")
        super().flush_cache()
        self.watch.leave(late, "engine.flush_cache")

    def weight_version(self) -> int | None:
        self.watch.enter("engine.weight_version")
        return super().weight_version()

    def is_idle(self) -> bool:
        self.watch.enter("engine.is_idle")
        return super().is_idle()

    def released(self) -> frozenset[EngineMemory]:
        self.watch.enter("engine.released")
        return super().released()


class WatchedTransport(InMemoryTransport):
    def __init__(self, trainer: WatchedTrainer, engine: WatchedEngine, calls: Calls) -> None:
        super().__init__(trainer, engine)
        self.watch, self.watched = calls, engine

    def push(self, version: int) -> TransferReport:
        late = self.watch.enter("transport.push")
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
        report = TransferReport(tensors=0, bytes=0, buckets=0)
        if late == "partial":  # the first bucket landed: half the weights, the version unchanged
            name, tensor = next(iter(self.trainer.sync_tensors()))
            self.engine.weights = {**self.engine.weights, name: tensor.clone()}
        else:
            report = super().push(version)
        self.watch.leave(late, "transport.push")
        return report


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

    # A deepcopy of the whole world per move costs ~20 ms (the `transitions` machine's callbacks);
    # the check instead saves what changes between moves and puts it back in place.
    def save(self) -> Saved:
        lc = self.lifecycle
        cause = lc.fault_cause
        return Saved(
            phase=lc.phase,
            known=_copied(vars_of(lc._known)),
            cause=(cause, list(getattr(cause, "__notes__", []))) if cause is not None else None,
            parts={name: _copied(vars(getattr(self, name))) for name in _PARTS},
        )

    def load(self, saved: Saved) -> None:
        """Put `saved` back into this same world: the adapters and the controller keep their
        identities, which the controller's parts hold between them."""
        lc = self.lifecycle
        lc._machine._machine.set_state(saved.phase, model=lc._machine._model)
        for field_name, value in saved.known.items():
            setattr(lc._known, field_name, _copied(value))
        lc.fault_cause = None
        if saved.cause is not None:
            lc.fault_cause, notes = saved.cause
            lc.fault_cause.__notes__ = list(notes)
        for name, state in saved.parts.items():
            vars(getattr(self, name)).update(_copied(state))
        self.calls.hazards, self.calls.names = [], []


_PARTS = ("trainer", "engine", "regions")


@dataclass(frozen=True)
class Saved:
    phase: Any
    known: dict[str, Any]
    cause: tuple[BaseException, list[str]] | None
    parts: dict[str, dict[str, Any]]


def vars_of(known: Any) -> dict[str, Any]:
    return {name: getattr(known, name) for name in known.__slots__}


def _copied(value: Any) -> Any:
    """Tensors cloned and containers rebuilt; anything else is immutable or shared on purpose
    (the adapters' references to each other and to `Calls`)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list | set):
        return type(value)(_copied(v) for v in value)
    return value


def build(mode: Mode, verify_cycles: int) -> World:
    calls = Calls()
    trainer = WatchedTrainer(mains={f"layer{i}.weight": torch.randn(2, 2) for i in range(2)}, extra=torch.zeros(2))
    trainer.attach(calls)
    regions = WatchedRegions(calls, trainer)
    engine = WatchedEngine(calls, regions)
    transport = WatchedTransport(trainer, engine, calls)
    config = LifecycleConfig(mode=mode, verify_cycles=verify_cycles, recover_idle_timeout_s=0.0)
    lifecycle = Lifecycle(
        config=config,
        trainer=trainer,
        regions=regions,
        engine=engine,
        transport=transport,
        listeners=[FaultsMeanwhile(calls)],
    )
    calls.fault = lifecycle.fault
    return World(lifecycle, trainer, engine, regions, calls)
