"""The vocabulary of the lifecycle: phases, events, modes and memory tags.

Pure data: this package imports nothing of the project.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where a colocated step is. Each phase fixes what is resident (docs/lifecycle.md)."""

    TRAIN = "TRAIN"
    GRADS_PAUSED = "GRADS_PAUSED"
    WEIGHTS_SYNCED = "WEIGHTS_SYNCED"
    PARAMS_DROPPED = "PARAMS_DROPPED"
    ROLLOUT = "ROLLOUT"
    FAULTED = "FAULTED"


class Event(StrEnum):
    """What moves the lifecycle from one phase to the next."""

    TRAIN = "train"
    SAVE = "save"
    PAUSE_GRADS = "pause_grads"
    UPDATE_WEIGHTS = "update_weights"
    SKIP_UPDATE = "skip_update"
    DROP_PARAMS = "drop_params"
    ROLLOUT = "rollout"
    RESTORE = "restore"
    FAULT = "fault"
    RECOVER = "recover"


class Mode(StrEnum):
    """How the bf16 params survive the rollout."""

    REMATERIALIZE = "rematerialize"  # rebuilt from the fp32 mains: cast + param all-gather
    BACKUP = "backup"  # a pinned host copy of every bf16 param (the baseline)
    TRAIN_ONLY = "train-only"  # debug run with no engine: weights are never synced


class Region(StrEnum):
    """Trainer memory regions, tagged as torch_memory_saver tags them."""

    PARAM_BUFFER = "param_buffer"  # bf16 params (Megatron DDP param buffers)
    GRAD_BUFFER = "grad_buffer"  # Megatron DDP grad buffers
    DEFAULT = "default"  # fp32 mains, Adam moments, module buffers, everything else


class Offload(StrEnum):
    """Which trainer regions leave the device for the rollout (docs/lifecycle.md, offload).

    `param_buffer` always leaves at drop_params: that is the phase. The choice is over the two
    regions pause_grads pauses, `grad_buffer` and `default`.
    """

    AUTO = "auto"  # the plan decides region by region: one the rollout fits beside stays resident
    ALWAYS = "always"  # both move every step
    NEVER = "never"  # both stay resident; refused where the plan says the rollout does not fit beside them


class EngineMemory(StrEnum):
    """Rollout-engine memory tags, as SGLang's /release_memory_occupation names them."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"


class Source(StrEnum):
    """Where a tensor handed to the weight sync lives."""

    PARAM_BUFFER = "param_buffer"  # a view into a DDP param buffer
    EXTRAS = "extras"  # the small pinned backup of tensors the fp32 mains cannot rebuild
    ELSEWHERE = "elsewhere"  # neither: a pointer the lifecycle cannot vouch for
