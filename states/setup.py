"""Facts about how the trainer is configured, as rematerialization needs to know them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSetup:
    """The trainer's configuration, reduced to what decides whether params can be rebuilt.

    Defaults describe the supported colocated setup; each field maps to a trainer flag.
    """

    colocate: bool = True  # trainer and engine share the GPUs
    offload_train: bool = True  # the trainer releases its memory for the rollout
    distributed_optimizer: bool = True  # fp32 mains live in a Megatron DistributedOptimizer
    compute_advantages: bool = True  # the per-step block that restores params runs
    lora: bool = False  # adapters train, base weights have no fp32 main
    optimizer_disabled: bool = False  # no optimizer: no fp32 mains to cast from
    keep_old_actor: bool = False  # an old-actor copy of the bf16 weights is kept
    overlap_param_gather: bool = False  # the param all-gather overlaps the next forward
    precision_aware_optimizer: bool = False  # the optimizer casts inside its own step
    optimizer_cpu_offload: bool = False  # the optimizer state lives on the host
    debug_train_only: bool = False  # a debug run that never rolls out
