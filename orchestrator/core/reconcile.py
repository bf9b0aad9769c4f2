"""The calls that close a difference between what the adapters report and what a phase needs.

Each reads the event's `Reading` (core/state.py) and calls an adapter only where it differs:
resume what is released, release what is held, rebuild params that are not cast(mains). Nothing
here is remembered from what the controller did, but `Decided.params_generation`: the generation
at which the params were last seen equal to cast(mains).
"""

from __future__ import annotations

from orchestrator.core.config import LifecycleConfig
from orchestrator.core.regions import RegionLedger
from orchestrator.core.state import ControllerState
from orchestrator.protocols import RolloutEngine, TrainerControl
from orchestrator.telemetry import semconv
from states import EngineMemory, Region


class Reconcile:
    """One rank's adapters, read for the event in flight and called only where they differ."""

    def __init__(
        self,
        config: LifecycleConfig,
        state: ControllerState,
        trainer: TrainerControl,
        regions: RegionLedger,
        engine: RolloutEngine | None,
    ) -> None:
        self.config, self.state = config, state
        self._trainer, self._regions, self._engine = trainer, regions, engine

    # ---- the engine -------------------------------------------------------------------------

    def engine_resume(self, tags: frozenset[EngineMemory]) -> None:
        """Resume those of `tags` the engine has released."""
        reading = self.state.reading
        missing = tags & reading.engine_released()
        if missing and self._engine is not None:
            try:
                self._engine.resume(missing)
            finally:
                reading.forget("engine")

    def engine_release(self, tags: frozenset[EngineMemory]) -> None:
        """Release those of `tags` the engine holds."""
        reading = self.state.reading
        held = tags & reading.engine_resident()
        if held and self._engine is not None:
            try:
                self._engine.release(held)
            finally:
                reading.forget("engine")

    # ---- the trainer ------------------------------------------------------------------------

    def params_seen_whole(self) -> None:
        """The params equal cast(mains) now (a step returned, a rebuild was verified)."""
        self.state.decided.params_generation = self.state.reading.trainer().mains_generation

    def bring_trainer_back(self) -> dict[str, int]:
        """Resume every region the adapter says is paused, then rebuild unless the params are
        current: a dropped param buffer lost them, and a step that began since they were last seen
        whole moved the mains under them. Returns the span's byte counts."""
        decided, reading = self.state.decided, self.state.reading
        paused = sorted(reading.paused())
        if Region.PARAM_BUFFER in paused:
            decided.params_generation = None
        retaken = sum(self._regions.resume(tag) for tag in paused)
        from_host = reading.regions().host_arena_bytes if Region.DEFAULT in paused else 0  # all of it came back
        written = 0
        if not self.state.params_current():
            decided.params_generation = None
            written = self._trainer.rebuild(self.config.mode)  # moves no mains: the reading holds
            if decided.digests is None:  # else current once verified
                self.params_seen_whole()
        decided.extras_stashed = False  # the next optimizer step makes them stale
        return {semconv.BYTES_RETAKEN: retaken, semconv.BYTES_REBUILT: written, semconv.BYTES_FROM_HOST: from_host}

    # ---- against TRAIN ----------------------------------------------------------------------

    def differences(self) -> list[str]:
        """How what the adapters report differs from TRAIN (docs/lifecycle.md, recovery): no
        region paused, no engine memory held, the params cast(mains)."""
        reading = self.state.reading
        found = [f"{tag} is paused" for tag in sorted(reading.paused())]
        held = reading.engine_resident()
        if held:
            found.append(f"the engine holds {', '.join(sorted(held))}")
        seen, now = self.state.decided.params_generation, reading.trainer().mains_generation
        if seen is None:
            found.append("the params are not known to be cast(mains): dropped, or rebuilt and not yet verified")
        elif seen != now:
            found.append(f"the mains moved under the params: an optimizer step began (generation {seen} → {now})")
        return found
