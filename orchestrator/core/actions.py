"""What each admitted event does: the memory choreography behind the rows of `states.TABLE`.

Guards decide whether an event may run (guards/); these actions only move memory and weights
through the adapters, and record what they did in `Decided` (core/state.py). Each reads what the
adapters say is true before it acts (the event's `Reading`: paused regions, released engine memory,
the mains' generation) and makes only the calls that close the difference. An action that raises
leaves the lifecycle FAULTED; `recover` then does the same against what TRAIN promises
(core/reconcile.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from guards.bitexact import restore_bit_identical
from orchestrator.core.config import LifecycleConfig
from orchestrator.core.reconcile import Reconcile
from orchestrator.core.regions import RegionLedger
from orchestrator.core.state import ALL, ControllerState
from orchestrator.errors import EngineError, RecoveryRefused, RestoreMismatch
from orchestrator.protocols import (
    RolloutEngine,
    SavedCheckpoint,
    TrainerControl,
    WeightTransport,
)
from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import TransitionRecord
from states import EngineMemory, Region

Work = Callable[[], Any]
Action = Callable[[TransitionRecord, "Work | None"], Any]

KV = frozenset({EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH})
WEIGHTS = frozenset({EngineMemory.WEIGHTS})
_IDLE_POLL_S = 0.05


class Actions:
    """The actions the table names, bound to one rank's adapters and its controller state."""

    def __init__(
        self,
        config: LifecycleConfig,
        state: ControllerState,
        trainer: TrainerControl,
        regions: RegionLedger,
        engine: RolloutEngine | None,
        transport: WeightTransport | None,
    ) -> None:
        self.config, self.state, self.known = config, state, state.decided
        self._trainer, self._regions, self._engine, self._transport = trainer, regions, engine, transport
        self.reconcile = Reconcile(config, state, trainer, regions, engine)

    def by_name(self) -> dict[str, Action]:
        return {
            "train_step": self.train_step,
            "save_checkpoint": self.save_checkpoint,
            "pause_trainer_state": self.pause_trainer_state,
            "push_weights": self.push_weights,
            "refill_engine_weights": self.refill_engine_weights,
            "drop_param_buffer": self.drop_param_buffer,
            "serve_rollout": self.serve_rollout,
            "restore_trainer": self.restore_trainer,
            "recover": self.recover,
        }

    def take_over_engine(self) -> None:
        """Release all of an attached engine's memory, so the trainer starts alone on the device."""
        self.reconcile.engine_release(ALL)
        self.reconcile.params_seen_whole()

    # ---- the cycle ------------------------------------------------------------------------

    def train_step(self, record: TransitionRecord, work: Work | None) -> Any:
        try:
            result = work() if work is not None else None
        finally:  # the actor trained if its optimizer began a step since the sync, whatever `work` was
            self.state.reading.forget("trainer")
            generation = self.state.reading.trainer().mains_generation
            self.known.trained_since_sync = generation != self.known.synced_generation
        self.reconcile.params_seen_whole()  # the step returned: it wrote the params from the mains it moved
        return result

    def save_checkpoint(self, record: TransitionRecord, work: Work | None) -> Any:
        saved = work() if work is not None else None
        record.attributes[semconv.WEIGHT_VERSION] = self.known.weight_version
        if isinstance(saved, SavedCheckpoint):
            record.attributes.update({semconv.CHECKPOINT: saved.path, semconv.BYTES_WRITTEN: saved.bytes})
        return saved

    def pause_trainer_state(self, record: TransitionRecord, work: Work | None) -> None:
        # The extras are stashed first: expert_bias lives in `default`, which is paused next.
        stashed = record.attributes[semconv.BYTES_STASHED] = self._trainer.stash(self.config.mode)
        self.known.extras_stashed = True
        keep = self.known.residency.keep
        moving = [tag for tag in (Region.GRAD_BUFFER, Region.DEFAULT) if tag not in keep]
        freed = sum(self._regions.pause(tag) for tag in moving)
        record.attributes[semconv.BYTES_FREED] = freed
        reading = self.state.reading
        reading.forget("trainer", "regions")  # what the stash and the pauses pinned, asked once
        arena = reading.regions().host_arena_bytes  # `default`'s whole contents went there, if it moved
        record.attributes[semconv.BYTES_TO_HOST] = stashed + arena
        record.attributes[semconv.HOST_PINNED_BYTES] = reading.trainer().host_pinned_bytes + arena

    def push_weights(self, record: TransitionRecord, work: Work | None) -> None:
        version = self.known.weight_version + 1
        self._sync(record, version)
        self.known.weight_version, self.known.trained_since_sync = version, False
        self.known.synced_generation = self.state.reading.trainer().mains_generation

    def refill_engine_weights(self, record: TransitionRecord, work: Work | None) -> None:
        """A critic-only step: the actor did not train, so the engine keeps its version. Its weight
        memory was released at the last restore (contents lost, as SGLang and the transformers
        engine lose them), so it is resumed and refilled with the same tensors at the same version."""
        if EngineMemory.WEIGHTS in self.state.reading.engine_resident():
            return
        self._sync(record, self.known.weight_version)

    def drop_param_buffer(self, record: TransitionRecord, work: Work | None) -> None:
        if self.known.cycles < self.config.verify_cycles:
            self.known.digests = dict(self._trainer.digests())
            record.attributes[semconv.TENSORS_DIGESTED] = len(self.known.digests)
        self.known.params_generation = None  # gone from here on, even if the pause raises after it took effect
        record.attributes[semconv.BYTES_FREED] = self._regions.pause(Region.PARAM_BUFFER)

    def serve_rollout(self, record: TransitionRecord, work: Work | None) -> Any:
        self.reconcile.engine_resume(KV)
        return work() if work is not None else None

    def restore_trainer(self, record: TransitionRecord, work: Work | None) -> None:
        self.reconcile.engine_release(ALL)
        record.attributes.update(self.reconcile.bring_trainer_back())
        # Back in TRAIN the regions' host arenas stay pinned for the next pause: count them here too.
        reading = self.state.reading
        reading.forget("trainer", "regions")
        record.attributes[semconv.HOST_PINNED_BYTES] = (
            reading.trainer().host_pinned_bytes + reading.regions().host_arena_bytes
        )
        cycle, self.known.cycles = self.known.cycles, self.known.cycles + 1
        self.known.last_restore_verified = None
        verdict = self._verify(record)
        if verdict is not None and not verdict.ok:
            raise RestoreMismatch(cycle, verdict)

    # ---- recovery: close what differs from TRAIN's promises, as the adapters report it -------

    def recover(self, record: TransitionRecord, work: Work | None) -> None:
        """Wait (bounded) for the engine to go idle; then, from what the adapters say is true now,
        release what the engine holds, resume every paused region, rebuild unless the params are
        current, verify them against a drop's digests, and look again before TRAIN is admitted.
        Each call closes a difference seen: none repeats one that already took effect."""
        self._await_engine_idle()
        record.attributes[semconv.RECONCILED] = tuple(self.reconcile.differences()) or ("nothing",)
        self.reconcile.engine_release(ALL)
        record.attributes.update(self.reconcile.bring_trainer_back())
        verdict = self._verify(record)
        if verdict is not None and not verdict.ok:
            raise RecoveryRefused([f"the rebuilt params differ from the digests taken at the drop: {verdict.reason}"])
        reading = self.state.begin()  # the look after the calls is asked afresh
        left = self.reconcile.differences()
        if left:
            raise RecoveryRefused([f"{difference}, after recover's calls returned" for difference in left])
        engine = reading.engine()
        served = engine.weight_version if engine is not None else None
        # A push may have landed before its flush or version check failed: continue past it.
        self.known.weight_version = max(self.known.weight_version, served or 0)
        # Whatever the engine holds now is suspect: it must be synced before it serves again.
        self.known.engine_synced = False
        record.attributes[semconv.WEIGHT_VERSION] = self.known.weight_version

    def _await_engine_idle(self) -> None:
        engine = self._engine
        if engine is None:
            return
        deadline = time.monotonic() + self.config.recover_idle_timeout_s
        while not self.state.begin().engine_idle():  # asked afresh at each look
            if time.monotonic() >= deadline:
                raise RecoveryRefused(
                    [
                        f"engine {engine.name} still has requests in flight after "
                        f"{self.config.recover_idle_timeout_s:g} s: releasing it would fail or lose them"
                    ]
                )
            time.sleep(_IDLE_POLL_S)

    # ---- shared steps -----------------------------------------------------------------------

    def _sync(self, record: TransitionRecord, version: int) -> None:
        engine, transport = self._engine, self._transport
        if engine is None or transport is None:  # unreachable past engine_attached; says so if not
            raise EngineError("none", "a weight sync needs an engine and a weight transport")
        self.reconcile.engine_resume(WEIGHTS)
        self.known.cache_flushed = False
        session = engine.weight_update_session(version)  # a session that does nothing, without `features.sessions`
        reading = self.state.reading
        try:
            with session:  # closed after the last bucket and the flush, or on a failure between
                report = transport.push(version)
                engine.flush_cache()
        finally:
            reading.forget("engine")  # it serves another version now, or may
        self.known.cache_flushed = True
        engine_state = reading.engine()
        served = engine_state.weight_version if engine_state is not None else None
        if served != version:
            raise EngineError(engine.name, f"serves version {served} after colocate pushed {version}")
        self.known.engine_synced = True
        record.attributes.update(
            {
                semconv.WEIGHT_VERSION: version,
                semconv.TENSORS: report.tensors,
                semconv.BYTES_MOVED: report.bytes,
                semconv.BUCKETS: report.buckets,
            }
        )

    def _verify(self, record: TransitionRecord) -> Any:
        """Compare the params with the digests taken at the drop, if this cycle took any."""
        if self.known.digests is None:
            return None
        verdict = restore_bit_identical(self.known.digests, self._trainer.digests())
        self.known.last_restore_verified = verdict.ok
        record.attributes[semconv.RESTORE_VERIFIED] = verdict.ok
        if verdict.ok:
            self.known.digests = None
            self.reconcile.params_seen_whole()
        return verdict
