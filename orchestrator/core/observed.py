"""What the adapters say is true now, and the calls that close a difference from it.

Nothing here is remembered from what the controller did: which regions are paused, which engine
memory is held and whether the mains moved are asked of the adapters at the moment they matter,
so a call that raised after it took effect leaves no stale belief behind. `Known.params_generation`
is the one thing kept: the generation at which the params were last seen equal to cast(mains).
"""

from __future__ import annotations

from orchestrator.core.config import LifecycleConfig
from orchestrator.core.known import Known
from orchestrator.core.regions import RegionLedger
from orchestrator.protocols import RolloutEngine, TrainerControl
from orchestrator.telemetry import semconv
from states import EngineMemory, Region

ALL = frozenset(EngineMemory)


class Observed:
    """One rank's adapters, read before each call and called only where they differ."""

    def __init__(
        self,
        config: LifecycleConfig,
        known: Known,
        trainer: TrainerControl,
        regions: RegionLedger,
        engine: RolloutEngine | None,
    ) -> None:
        self.config, self.known = config, known
        self._trainer, self._regions, self._engine = trainer, regions, engine

    # ---- the engine -------------------------------------------------------------------------

    def engine_resident(self) -> frozenset[EngineMemory]:
        """What the engine says it holds now (nothing, without an engine)."""
        return ALL - self._engine.released() if self._engine is not None else frozenset()

    def engine_resume(self, tags: frozenset[EngineMemory]) -> None:
        """Resume those of `tags` the engine has released."""
        if self._engine is None:
            return
        missing = tags & self._engine.released()
        if missing:
            self._engine.resume(missing)

    def engine_release(self, tags: frozenset[EngineMemory]) -> None:
        """Release those of `tags` the engine holds."""
        held = tags & self.engine_resident()
        if held and self._engine is not None:
            self._engine.release(held)

    # ---- the trainer ------------------------------------------------------------------------

    def params_current(self) -> bool:
        """The params are cast(mains): seen so at a generation the mains have not moved past."""
        seen = self.known.params_generation
        return seen is not None and seen == self._trainer.mains_generation()

    def params_seen_whole(self) -> None:
        """The params equal cast(mains) now (a step returned, a rebuild was verified)."""
        self.known.params_generation = self._trainer.mains_generation()

    def bring_trainer_back(self) -> dict[str, int]:
        """Resume every region the adapter says is paused, then rebuild unless the params are
        current: a dropped param buffer lost them, and a step that began since they were last seen
        whole moved the mains under them. Returns the span's byte counts."""
        paused = sorted(self._regions.paused)
        if Region.PARAM_BUFFER in paused:
            self.known.params_generation = None
        retaken = sum(self._regions.resume(tag) for tag in paused)
        from_host = self._regions.host_arena_bytes() if Region.DEFAULT in paused else 0  # all of it came back
        written = 0
        if not self.params_current():
            self.known.params_generation = None
            written = self._trainer.rebuild(self.config.mode)
            if self.known.digests is None:  # else current once verified
                self.params_seen_whole()
        self.known.extras_stashed = False  # the next optimizer step makes them stale
        return {semconv.BYTES_RETAKEN: retaken, semconv.BYTES_REBUILT: written, semconv.BYTES_FROM_HOST: from_host}

    # ---- against TRAIN ----------------------------------------------------------------------

    def differences(self) -> list[str]:
        """How what the adapters report differs from TRAIN (docs/lifecycle.md, recovery): no
        region paused, no engine memory held, the params cast(mains)."""
        found = [f"{tag} is paused" for tag in sorted(self._regions.paused)]
        held = self.engine_resident()
        if held:
            found.append(f"the engine holds {', '.join(sorted(held))}")
        seen, now = self.known.params_generation, self._trainer.mains_generation()
        if seen is None:
            found.append("the params are not known to be cast(mains): dropped, or rebuilt and not yet verified")
        elif seen != now:
            found.append(f"the mains moved under the params: an optimizer step began (generation {seen} → {now})")
        return found
