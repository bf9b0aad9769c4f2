"""The controller's state, in one place: what colocate decided, and what the adapters report.

- `Decided`: what one rank's controller did or chose and cannot ask an adapter for (the step,
  the versions it pushed, the extras' stash, the digests of a verified cycle, the offload choice).
  The actions write it; nothing else does.
- `Reading`: what the adapters report, asked for one event: each component once, with one
  `state()` call, and only if the event's guards or action read it. It is never carried to the
  next event: which regions are paused, which engine memory is released, whether the mains moved,
  which version the engine serves are asked afresh, so a call that failed after it took effect
  leaves no stale belief. A call that changes what a component reports (a pause, a release, a
  push) forgets that component's answer; whatever is read after it is asked again.
- `ControllerState`: both, built once by `Lifecycle` in this order, with the fault latch that
  holds a fault for the event in flight (core/latch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.config import LifecycleConfig
from orchestrator.core.latch import FaultLatch
from orchestrator.core.offload import Residency
from orchestrator.protocols import (
    EngineState,
    MemoryRegions,
    RegionsState,
    RolloutEngine,
    TrainerControl,
    TrainerState,
)
from states import EngineMemory, MemoryBudget, Phase, Region, Snapshot, TrainerLayout

ALL = frozenset(EngineMemory)
_TAGS = frozenset(r.value for r in Region)
# What a guard's snapshot fields are read from: `guards.READS` names these per guard.
COMPONENTS = ("regions", "trainer", "engine", "memory")


@dataclass(slots=True)
class Decided:
    """What the controller knows because it did it or chose it."""

    step: int = 0
    # The engine: whether it serves the weights of the last sync, which version that was, and
    # whether its cache was flushed after the sync's last bucket.
    engine_synced: bool = False
    weight_version: int = 0
    cache_flushed: bool = True
    # The trainer: whether the actor's optimizer began a step since the last sync (its
    # `mains_generation` moved from `synced_generation`; a critic's work under `train` does not
    # move it); the extras (expert_bias, fp32 and frozen params) stashed before `default` is paused.
    trained_since_sync: bool = False
    synced_generation: int | None = None
    extras_stashed: bool = False
    # The trainer's `mains_generation` when the params were last seen equal to cast(mains): after
    # a train event's work returned, after a rebuild that needs no check. None while they are
    # dropped or unchecked. A generation that moved since means a step began after: rebuild.
    params_generation: int | None = None
    cycles: int = 0  # completed drop/restore cycles
    digests: dict[str, str] | None = None  # taken at the drop of a verified cycle, kept until verified
    last_restore_verified: bool | None = None
    # The offload choice (core/offload.py): made once, when the engine is released at start-up.
    residency: Residency = field(default_factory=Residency)


class Reading:
    """The adapters' answers for one event, each asked on first use and kept until forgotten."""

    def __init__(
        self,
        trainer: TrainerControl | None,
        regions: MemoryRegions,
        engine: RolloutEngine | None,
        memory: Callable[[], MemoryBudget] | None,
    ) -> None:
        """`trainer` None: a reading of the regions alone (`RegionLedger` without a lifecycle)."""
        self._trainer, self._regions, self._engine, self._memory = trainer, regions, engine, memory
        # The job's rank group is trainer and regions at once: its ranks answer for both together.
        self._together = regions is trainer
        self._answers: dict[str, Any] = {}
        self._noted: dict[Region, bool] = {}  # pauses and resumes that returned since `regions` answered

    def _ask(self, component: str, call: Callable[[], Any]) -> Any:
        if component not in self._answers:
            self._answers[component] = call()
        return self._answers[component]

    def trainer(self) -> TrainerState:
        trainer = self._trainer
        assert trainer is not None, "a reading of the regions alone has no trainer to ask"
        return self._ask("trainer", trainer.state)  # type: ignore[no-any-return]

    def regions(self) -> RegionsState:
        if self._together:
            both = self.trainer()
            if both.regions is not None:
                return both.regions
        return self._ask("regions", self._regions.state)  # type: ignore[no-any-return]

    def engine(self) -> EngineState | None:
        engine = self._engine
        return None if engine is None else self._ask("engine", engine.state)

    def memory(self) -> MemoryBudget | None:
        memory = self._memory
        return None if memory is None else self._ask("memory", memory)

    def forget(self, *components: str) -> None:
        """A call changed what these components report: ask them again when next read."""
        for component in components:
            self._answers.pop(component, None)
            if component == "regions" or (self._together and component == "trainer"):
                self._noted.clear()
                self._answers.pop("paused", None)
            if self._together and component in ("trainer", "regions"):
                self._answers.pop("trainer", None)
                self._answers.pop("regions", None)

    def note(self, region: Region, paused: bool) -> None:
        """A pause (or resume) of `region` returned: it is paused (or resident) now. What else the
        call changed (the host bytes a first pause pins) is read only after a `forget`."""
        self._noted[region] = paused

    # ---- what the guards and actions read of them --------------------------------------------

    def paused(self) -> frozenset[Region]:
        """What the adapter says is paused now, with the pauses and resumes that returned since."""
        said = self._ask("paused", lambda: frozenset(Region(t) for t in self.regions().paused if t in _TAGS))
        if not self._noted:
            return said  # type: ignore[no-any-return]
        return frozenset({r for r, paused in self._noted.items() if paused} | (said - self._noted.keys()))

    def engine_resident(self) -> frozenset[EngineMemory]:
        """What the engine says it holds now (nothing, without an engine)."""
        engine = self.engine()
        return ALL - engine.released if engine is not None else frozenset()

    def engine_released(self) -> frozenset[EngineMemory]:
        engine = self.engine()
        return engine.released if engine is not None else ALL

    def engine_idle(self) -> bool:
        engine = self.engine()
        return engine.idle if engine is not None else True


class ControllerState:
    """One rank's controller state: `decided` (written by the actions), the fault `latch`, and
    the `reading` of the event in flight (a fresh one for each event, `begin`)."""

    def __init__(
        self,
        config: LifecycleConfig,
        layout: TrainerLayout,
        trainer: TrainerControl,
        regions: MemoryRegions,
        engine: RolloutEngine | None,
        *,
        weight_version: int,
    ) -> None:
        self.config, self.layout, self.engine_attached = config, layout, engine is not None
        self.decided = Decided(weight_version=weight_version)
        self.latch = FaultLatch()
        self._components = (trainer, regions, engine, config.memory)
        self.reading = Reading(*self._components)

    def begin(self) -> Reading:
        """A fresh reading for the event about to be judged: nothing is carried from the last."""
        self.reading = Reading(*self._components)
        return self.reading

    def params_current(self) -> bool:
        """The params are cast(mains): seen so at a generation the mains have not moved past."""
        seen = self.decided.params_generation
        return seen is not None and seen == self.reading.trainer().mains_generation

    def snapshot(self, phase: Phase, asks: frozenset[str]) -> Snapshot:
        """What guards judge in `phase`: the decided facts, and of the reading the components in
        `asks` (`COMPONENTS`); a field of any other is `Unasked`, which no guard may use."""
        decided, reading = self.decided, self.reading
        engine = reading.engine() if "engine" in asks else None

        def asked(component: str, field: str, value: Callable[[], Any]) -> Any:
            return value() if component in asks else Unasked(field)

        return Snapshot(
            phase=phase,
            mode=self.config.mode,
            step=decided.step,
            paused=asked("regions", "paused", reading.paused),
            engine_attached=self.engine_attached,
            engine_resident=asked("engine", "engine_resident", reading.engine_resident),
            engine_idle=asked("engine", "engine_idle", reading.engine_idle),
            engine_synced=decided.engine_synced,
            engine_version=asked("engine", "engine_version", lambda: engine.weight_version if engine else None),
            weight_version=decided.weight_version,
            cache_flushed=decided.cache_flushed,
            trained_since_sync=decided.trained_since_sync,
            extras_stashed=decided.extras_stashed,
            params_valid=asked("trainer", "params_valid", self.params_current),
            layout=self.layout,
            memory=asked("memory", "memory", reading.memory) if self.config.memory is not None else None,
            kept=decided.residency.keep,
        )


class Unasked:
    """A snapshot field whose component the event did not ask: any use of it means a guard read
    what `guards.READS` does not list for it, and raises rather than judging a guess."""

    __slots__ = ("field",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, field: str) -> None:
        self.field = field

    def _refuse(self, *_: object) -> Any:
        raise AssertionError(f"a guard read the snapshot's {self.field}, which guards.READS does not list for it")

    __bool__ = __iter__ = __contains__ = __len__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse  # type: ignore[assignment]
    __and__ = __rand__ = __or__ = __ror__ = __sub__ = __rsub__ = __getattr__ = _refuse
