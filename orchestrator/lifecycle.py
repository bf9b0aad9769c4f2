"""The lifecycle controller: one `transitions` machine, built from `states.TABLE`.

An event is admitted only if the table has a row for it in the current phase and every guard of
that row accepts the current snapshot. Its action then moves memory through the adapters; if
the action raises, the controller goes to FAULTED and keeps the cause. Nothing but `recover`
is legal there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from transitions import EventData, Machine

from guards import GUARDS, evaluate, refusals
from guards.bitexact import restore_bit_identical
from orchestrator.config import LifecycleConfig
from orchestrator.errors import (
    ActionFailed,
    ConfigError,
    EngineError,
    GuardRejected,
    IllegalTransition,
    LifecycleError,
    RestoreMismatch,
)
from orchestrator.listeners import FanOut, Listener, TransitionRecord
from orchestrator.protocols import MemoryRegions, RolloutEngine, Trainer, WeightTransport, WeightUpdateSessions
from orchestrator.regions import RegionLedger
from states import INITIAL, TABLE, EngineMemory, Event, Mode, Phase, Region, Snapshot, TrainerLayout, Transition

T = TypeVar("T")
Work = Callable[[], Any]

_KV = frozenset({EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH})


@dataclass(slots=True)
class _Tracked:
    """What the controller knows because it did it (never re-derived from the adapters)."""

    step: int = 0
    engine_resident: frozenset[EngineMemory] = frozenset()
    engine_synced: bool = False
    weight_version: int = 0
    cache_flushed: bool = True
    trained_since_sync: bool = False
    extras_stashed: bool = False
    cycles: int = 0  # completed drop/restore cycles
    digests: dict[str, str] | None = None  # taken at the drop of a verified cycle


def require_restore_coverage(layout: TrainerLayout) -> None:
    """Every param must come back after a drop: rebuilt from a DDP buffer, or an extra."""
    if layout.uncovered:
        raise ConfigError([f"{name}: in no DDP param buffer and not an extra" for name in layout.uncovered])


class _Machine:
    """The `transitions` model. Kept apart so its trigger methods never shadow the public API."""

    state: Phase
    trigger: Callable[..., bool]  # added by Machine


class Lifecycle:
    """Drives one rank through train → pause_grads → update_weights → drop_params → rollout → restore.

    The engine is taken over at construction: its memory is released so the trainer starts
    alone on the device, as in the TRAIN row of the memory table (docs/lifecycle.md).
    """

    def __init__(
        self,
        *,
        config: LifecycleConfig,
        trainer: Trainer,
        regions: MemoryRegions,
        engine: RolloutEngine | None = None,
        transport: WeightTransport | None = None,
        listeners: list[Listener] | tuple[Listener, ...] = (),
    ) -> None:
        self.config = config
        self._check_wiring(engine, transport)
        self._trainer, self._engine, self._transport = trainer, engine, transport
        self._regions = RegionLedger(regions)
        self._layout = trainer.layout()
        if config.mode is not Mode.TRAIN_ONLY:
            require_restore_coverage(self._layout)
        self.listeners = FanOut(listeners)
        # Versions continue from what an attached engine already serves (an earlier job's
        # weights), so they keep increasing; it still serves nothing of this job's before a sync.
        self._t = _Tracked(weight_version=(engine.weight_version() or 0) if engine is not None else 0)
        self.last_restore_verified: bool | None = None
        self.fault_cause: BaseException | None = None
        self._rows = {(row.source, row.event): row for row in TABLE}
        self._actions: dict[str, Callable[[TransitionRecord, Work | None], Any]] = {
            "train_step": self._train_step,
            "save_checkpoint": self._save_checkpoint,
            "pause_trainer_state": self._pause_trainer_state,
            "push_weights": self._push_weights,
            "drop_param_buffer": self._drop_param_buffer,
            "serve_rollout": self._serve_rollout,
            "restore_trainer": self._restore_trainer,
            "recover": self._recover,
        }
        self._model = _Machine()
        self._machine = Machine(
            model=self._model,
            states=Phase,
            transitions=[self._spec(row) for row in TABLE],
            initial=INITIAL,
            auto_transitions=False,
            send_event=True,
        )
        self._pending: tuple[TransitionRecord, Work | None] | None = None
        self._result: Any = None
        if engine is not None:
            self._engine_release(frozenset(EngineMemory), already_resident=True)

    def _check_wiring(self, engine: RolloutEngine | None, transport: WeightTransport | None) -> None:
        if self.config.mode is Mode.TRAIN_ONLY:
            if engine is not None or transport is not None:
                raise ConfigError(["a train-only run takes no engine and no transport"])
        elif engine is None or transport is None:
            raise ConfigError([f"mode {self.config.mode} needs an engine and a weight transport"])

    def _spec(self, row: Transition) -> dict[str, Any]:
        unknown = [g for g in row.guards if g not in GUARDS] + (
            [row.action] if row.action and row.action not in self._actions else []
        )
        if unknown:
            raise ConfigError([f"table row {row.source}.{row.event} names unknown {name!r}" for name in unknown])
        return {
            "trigger": row.event.value,
            "source": row.source,
            "dest": row.dest,
            "conditions": [partial(self._admit, row)],
            "before": [partial(self._act, row)],
        }

    # ---- reading the state -------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._model.state

    @property
    def weight_version(self) -> int:
        return self._t.weight_version

    def legal_events(self, phase: Phase | None = None) -> tuple[Event, ...]:
        phase = self.phase if phase is None else phase
        return tuple(event for (source, event) in self._rows if source is phase)

    def snapshot(self) -> Snapshot:
        engine = self._engine
        return Snapshot(
            phase=self.phase,
            mode=self.config.mode,
            step=self._t.step,
            paused=self._regions.paused,
            engine_attached=engine is not None,
            engine_resident=self._t.engine_resident,
            engine_idle=engine.is_idle() if engine is not None else True,
            engine_synced=self._t.engine_synced,
            engine_version=engine.weight_version() if engine is not None else None,
            weight_version=self._t.weight_version,
            cache_flushed=self._t.cache_flushed,
            trained_since_sync=self._t.trained_since_sync,
            extras_stashed=self._t.extras_stashed,
            layout=self._layout,
        )

    # ---- firing events -----------------------------------------------------------------------

    @contextmanager
    def step(self, number: int | None = None) -> Iterator[int]:
        """Group the transitions of one training step (one trace, one parent span)."""
        self._t.step = self._t.step + 1 if number is None else number
        self.listeners.on_step_start(self._t.step, self.config.rank)
        try:
            yield self._t.step
        except BaseException as exc:
            self.listeners.on_step_end(self._t.step, self.config.rank, exc)
            raise
        self.listeners.on_step_end(self._t.step, self.config.rank, None)

    def fire(self, event: Event, work: Work | None = None) -> Any:
        """Admit `event`, run its action (and `work`, the caller's part of it), change phase.

        Raises IllegalTransition or GuardRejected with the phase unchanged, or ActionFailed
        once the lifecycle is FAULTED. Returns what `work` returned.
        """
        src = self.phase
        row = self._rows.get((src, event))
        record = TransitionRecord(
            event,
            src,
            row.dest if row else src,
            self._t.step,
            self.config.rank,
            self.config.mode,
            time.perf_counter_ns(),
        )
        if row is None:
            self._reject(record, IllegalTransition(src, event, self.legal_events(src)))
        self._pending, self._result = (record, work), None
        try:
            moved = self._model.trigger(event.value)
        except Exception as exc:
            self._fail(record, exc)
        if not moved:
            self._reject(record, GuardRejected(src, event, refusals(record.verdicts)))
        record.ended_ns = time.perf_counter_ns()
        self.listeners.on_transition(record)
        return self._result

    def _admit(self, row: Transition, _: EventData) -> bool:
        record, _work = self._pending  # type: ignore[misc]
        record.verdicts = evaluate((GUARDS[name] for name in row.guards), self.snapshot())
        return all(v.ok for v in record.verdicts)

    def _act(self, row: Transition, _: EventData) -> None:
        record, work = self._pending  # type: ignore[misc]
        self.listeners.on_begin(record)
        if row.action is not None:
            self._result = self._actions[row.action](record, work)

    def _reject(self, record: TransitionRecord, error: LifecycleError) -> None:
        record.ended_ns = time.perf_counter_ns()
        self.listeners.on_rejected(record, error)
        raise error

    def _fail(self, record: TransitionRecord, exc: Exception) -> None:
        record.ended_ns = time.perf_counter_ns()
        error = ActionFailed(record.src, record.event, exc)
        self.listeners.on_fault(record, error)
        if record.src is not Phase.FAULTED:
            self.fault(exc)
        raise error from exc

    def fault(self, cause: BaseException | str) -> None:
        """Move to FAULTED from outside (a rank died, a watchdog fired). Only `recover` leaves it."""
        self.fault_cause = cause if isinstance(cause, BaseException) else RuntimeError(cause)
        record = TransitionRecord(
            Event.FAULT,
            self.phase,
            Phase.FAULTED,
            self._t.step,
            self.config.rank,
            self.config.mode,
            time.perf_counter_ns(),
        )
        record.attributes["colocate.cause"] = f"{type(self.fault_cause).__name__}: {self.fault_cause}"
        if self.phase is Phase.FAULTED:
            self._reject(record, IllegalTransition(self.phase, Event.FAULT, self.legal_events()))
        self._pending = (record, None)
        self._model.trigger(Event.FAULT.value)
        record.ended_ns = time.perf_counter_ns()
        self.listeners.on_transition(record)

    # The cycle, as a run loop reads it.
    def train(self, work: Work | None = None) -> Any:
        return self.fire(Event.TRAIN, work)

    def save(self, work: Work | None = None) -> Any:
        return self.fire(Event.SAVE, work)

    def pause_grads(self) -> None:
        self.fire(Event.PAUSE_GRADS)

    def update_weights(self) -> None:
        self.fire(Event.UPDATE_WEIGHTS)

    def skip_update(self) -> None:
        self.fire(Event.SKIP_UPDATE)

    def drop_params(self) -> None:
        self.fire(Event.DROP_PARAMS)

    def rollout(self, work: Work | None = None) -> Any:
        return self.fire(Event.ROLLOUT, work)

    def restore(self) -> None:
        self.fire(Event.RESTORE)

    def recover(self) -> None:
        self.fire(Event.RECOVER)

    # ---- actions: the memory choreography of each event -------------------------------------

    def _train_step(self, record: TransitionRecord, work: Work | None) -> Any:
        result = work() if work is not None else None
        self._t.trained_since_sync = True
        return result

    def _save_checkpoint(self, record: TransitionRecord, work: Work | None) -> Any:
        return work() if work is not None else None

    def _pause_trainer_state(self, record: TransitionRecord, work: Work | None) -> None:
        # The extras are stashed first: expert_bias lives in `default`, which is paused next.
        record.attributes["colocate.bytes_stashed"] = self._trainer.stash(self.config.mode)
        self._t.extras_stashed = True
        freed = self._regions.pause(Region.GRAD_BUFFER) + self._regions.pause(Region.DEFAULT)
        record.attributes["colocate.bytes_freed"] = freed
        record.attributes["colocate.host_pinned_bytes"] = self._trainer.host_pinned_bytes()

    def _push_weights(self, record: TransitionRecord, work: Work | None) -> None:
        engine, transport = self._engine, self._transport
        if engine is None or transport is None:  # unreachable past engine_attached; says so if not
            raise ConfigError(["update_weights needs an engine and a weight transport"])
        self._engine_resume(frozenset({EngineMemory.WEIGHTS}))
        self._require(Event.UPDATE_WEIGHTS, "engine_weights_resident")
        version = self._t.weight_version + 1
        self._t.cache_flushed = False
        session: AbstractContextManager[None] = (
            engine.weight_update_session() if isinstance(engine, WeightUpdateSessions) else nullcontext()
        )
        with session:  # closed after the last bucket and the flush, or on the failure between
            report = transport.push(version)
            engine.flush_cache()
        self._t.cache_flushed = True
        served = engine.weight_version()
        if served != version:
            raise EngineError(engine.name, f"serves version {served} after colocate pushed {version}")
        self._t.weight_version, self._t.engine_synced, self._t.trained_since_sync = version, True, False
        record.attributes.update(
            {
                "colocate.weight_version": version,
                "colocate.tensors": report.tensors,
                "colocate.bytes_moved": report.bytes,
                "colocate.buckets": report.buckets,
            }
        )

    def _drop_param_buffer(self, record: TransitionRecord, work: Work | None) -> None:
        if self._t.cycles < self.config.verify_cycles:
            self._t.digests = dict(self._trainer.digests())
            record.attributes["colocate.tensors_digested"] = len(self._t.digests)
        record.attributes["colocate.bytes_freed"] = self._regions.pause(Region.PARAM_BUFFER)

    def _serve_rollout(self, record: TransitionRecord, work: Work | None) -> Any:
        self._engine_resume(_KV)
        return work() if work is not None else None

    def _restore_trainer(self, record: TransitionRecord, work: Work | None) -> None:
        self._engine_release(self._t.engine_resident)
        record.attributes.update(self._bring_trainer_back())
        cycle, self._t.cycles = self._t.cycles, self._t.cycles + 1
        self.last_restore_verified = None
        if self._t.digests is not None:
            verdict = restore_bit_identical(self._t.digests, self._trainer.digests())
            self._t.digests = None
            self.last_restore_verified = verdict.ok
            record.attributes["colocate.restore_verified"] = verdict.ok
            if not verdict.ok:
                raise RestoreMismatch(cycle, verdict)

    def _recover(self, record: TransitionRecord, work: Work | None) -> None:
        self._engine_release(self._t.engine_resident)
        record.attributes.update(self._bring_trainer_back())
        # Whatever the engine holds now is suspect: it must be synced before it serves again.
        self._t.engine_synced, self._t.digests = False, None
        self.fault_cause = None

    def _bring_trainer_back(self) -> dict[str, int]:
        rebuild = Region.PARAM_BUFFER in self._regions.paused
        retaken = sum(self._regions.resume(tag) for tag in sorted(self._regions.paused))
        written = self._trainer.rebuild(self.config.mode) if rebuild else 0
        self._t.extras_stashed = False  # the next optimizer step makes them stale
        return {"colocate.bytes_retaken": retaken, "colocate.bytes_rebuilt": written}

    def _require(self, event: Event, guard: str) -> None:
        verdict = GUARDS[guard](self.snapshot())
        if not verdict.ok:
            raise GuardRejected(self.phase, event, [verdict])

    def _engine_resume(self, tags: frozenset[EngineMemory]) -> None:
        missing = tags - self._t.engine_resident
        if missing and self._engine is not None:
            self._engine.resume(missing)
            self._t.engine_resident |= missing

    def _engine_release(self, tags: frozenset[EngineMemory], *, already_resident: bool = False) -> None:
        held = tags if already_resident else tags & self._t.engine_resident
        if held and self._engine is not None:
            self._engine.release(held)
        self._t.engine_resident -= held
