"""The one table of legal transitions. Nothing else declares a transition.

Read it top to bottom: it is the colocated step. Guards and actions are named here and resolved
once when the controller is built (guards/ and orchestrator/core/lifecycle.py), so an unknown name
fails at import, not mid-run.
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
    Transition(P.TRAIN,          E.SAVE,            P.TRAIN,          ("trainer_resident",),                        "save_checkpoint"),
    Transition(P.TRAIN,          E.PAUSE_GRADS,     P.GRADS_PAUSED,   ("engine_attached", "trainer_resident",
                                                                       "restore_coverage"),                         "pause_trainer_state"),
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
