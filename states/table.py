"""The one table of legal transitions. Nothing else declares a transition.

Read it top to bottom: it is the colocated step, and `CYCLE` reads that step off it for whatever
lists a step's events or phases in order. Guards and actions are named here and resolved once when
the controller is built (guards/ and orchestrator/core/lifecycle.py), so an unknown name fails at
import, not mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass

from states.phases import Event, Phase


@dataclass(frozen=True, slots=True)
class Transition:
    source: Phase
    event: Event
    dest: Phase
    guards: tuple[str, ...] = ()
    action: str | None = None


P, E = Phase, Event
# fmt: off
TABLE: tuple[Transition, ...] = (
    #          source            event              dest              guards                                        action
    Transition(P.TRAIN,          E.TRAIN,           P.TRAIN,          ("trainer_resident",),                        "train_step"),
    Transition(P.TRAIN,          E.SAVE,            P.TRAIN,          ("trainer_resident", "params_valid",
                                                                       "engine_version_known"),                     "save_checkpoint"),
    Transition(P.TRAIN,          E.PAUSE_GRADS,     P.GRADS_PAUSED,   ("engine_attached", "trainer_resident",
                                                                       "restore_coverage", "memory_fits"),          "pause_trainer_state"),
    Transition(P.GRADS_PAUSED,   E.UPDATE_WEIGHTS,  P.WEIGHTS_SYNCED, ("weights_changed", "sync_source_resident",
                                                                       "engine_kv_released", "version_increasing",
                                                                       "memory_fits"),                              "push_weights"),
    Transition(P.GRADS_PAUSED,   E.SKIP_UPDATE,     P.WEIGHTS_SYNCED, ("weights_unchanged", "engine_synced",
                                                                       "sync_source_resident", "engine_kv_released",
                                                                       "memory_fits"),                              "refill_engine_weights"),
    Transition(P.WEIGHTS_SYNCED, E.DROP_PARAMS,     P.PARAMS_DROPPED, ("restore_coverage", "cache_flushed"),        "drop_param_buffer"),
    Transition(P.PARAMS_DROPPED, E.ROLLOUT,         P.ROLLOUT,        ("params_dropped", "engine_synced",
                                                                       "engine_weights_resident", "cache_flushed",
                                                                       "memory_fits"),                              "serve_rollout"),
    Transition(P.ROLLOUT,        E.RESTORE,         P.TRAIN,          ("engine_idle", "memory_fits"),               "restore_trainer"),
    # Any phase may fault; only recover leaves FAULTED.
    *(Transition(phase, E.FAULT, P.FAULTED) for phase in Phase if phase is not P.FAULTED),
    Transition(P.FAULTED,        E.RECOVER,         P.TRAIN,          (),                                           "recover"),
)
# fmt: on
del P, E

INITIAL = Phase.TRAIN


def _cycle(table: tuple[Transition, ...], initial: Phase) -> tuple[Transition, ...]:
    """One colocated step, read off the table: the first row that stays in `initial` (the step's
    own work), then out of each phase the first row listed that leaves it, until back in `initial`.
    The other rows (save, skip_update, fault, recover) are alternatives to the cycle, not part of it."""

    def first(phase: Phase, stays: bool) -> Transition:
        rows = [t for t in table if t.source is phase and (t.dest is phase) is stays and t.dest is not Phase.FAULTED]
        if not rows:
            raise ValueError(f"the table has no row {'staying in' if stays else 'leaving'} {phase}: no cycle")
        return rows[0]

    cycle = [first(initial, stays=True), first(initial, stays=False)]
    while cycle[-1].dest is not initial:
        row = first(cycle[-1].dest, stays=False)
        if row in cycle:
            raise ValueError(f"the table's cycle never returns to {initial}: {row.source} → {row.dest} repeats")
        cycle.append(row)
    return tuple(cycle)


# The colocated step's rows in order, for whatever lists a step's events or phases.
CYCLE = _cycle(TABLE, INITIAL)
