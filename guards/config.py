"""Configuration guards: what rematerialization requires and what it excludes.

Each check reads a `TrainingSetup`; `violations()` runs every check that applies to a mode, so a
bad configuration is reported whole, not one flag per attempt.
"""

from __future__ import annotations

from collections.abc import Callable

from guards.verdict import Verdict, evaluate, guard, refusals
from states import Mode, TrainingSetup


@guard
def colocated(setup: TrainingSetup) -> str | None:
    return None if setup.colocate else "rematerialize needs colocate: the engine must share the trainer's GPUs"


@guard
def trainer_offloads(setup: TrainingSetup) -> str | None:
    return None if setup.offload_train else "rematerialize needs trainer offload: nothing is dropped otherwise"


@guard
def distributed_optimizer(setup: TrainingSetup) -> str | None:
    if setup.distributed_optimizer:
        return None
    return "rematerialize needs the distributed optimizer: its fp32 mains are what params are rebuilt from"


@guard
def advantages_computed(setup: TrainingSetup) -> str | None:
    if setup.compute_advantages:
        return None
    return "rematerialize needs advantages computed: the per-step restore runs in that block"


@guard
def no_lora(setup: TrainingSetup) -> str | None:
    return "LoRA base weights have no fp32 main to rebuild from" if setup.lora else None


@guard
def optimizer_enabled(setup: TrainingSetup) -> str | None:
    return "a disabled optimizer has no fp32 mains to rebuild from" if setup.optimizer_disabled else None


@guard
def no_old_actor_copy(setup: TrainingSetup) -> str | None:
    if setup.keep_old_actor:
        return "an old-actor copy of the bf16 weights cannot be rebuilt from the current fp32 mains"
    return None


@guard
def no_overlap_param_gather(setup: TrainingSetup) -> str | None:
    if setup.overlap_param_gather:
        return "overlap-param-gather defers the all-gather into the next forward: the restore would be partial"
    return None


@guard
def optimizer_casts_mains(setup: TrainingSetup) -> str | None:
    if setup.precision_aware_optimizer and not setup.optimizer_cpu_offload:
        return (
            "a precision-aware optimizer without CPU offload makes _copy_main_params_to_model_params a no-op: "
            "nothing would be rebuilt"
        )
    return None


@guard
def not_debug_train_only(setup: TrainingSetup) -> str | None:
    if setup.debug_train_only:
        return "a debug train-only run never updates weights: use mode train-only"
    return None


_REMATERIALIZE = (
    colocated,
    trainer_offloads,
    distributed_optimizer,
    advantages_computed,
    no_lora,
    optimizer_enabled,
    no_old_actor_copy,
    no_overlap_param_gather,
    optimizer_casts_mains,
    not_debug_train_only,
)
CHECKS: dict[Mode, tuple[Callable[[TrainingSetup], Verdict], ...]] = {
    Mode.REMATERIALIZE: _REMATERIALIZE,
    Mode.BACKUP: (not_debug_train_only,),
    Mode.TRAIN_ONLY: (),
}


def violations(mode: Mode, setup: TrainingSetup) -> tuple[Verdict, ...]:
    """Every check of `mode` that `setup` fails."""
    return refusals(evaluate(CHECKS[mode], setup))
