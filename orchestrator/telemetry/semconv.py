"""colocate's telemetry names: every span name, span event and `colocate.*` attribute key, once.

Spans are written by `telemetry.tracing`, the core's actions, the adapters and the job's
workers, and read back by `colocate trace` (cli/traces) and the run report: all of them name
what they write or read through these constants, so the writer and the reader cannot drift
apart. docs/tracing.md lists the same names (tests/docs checks that it does).

Imports nothing of the project but `states`, so every layer above can use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from states import Event

PREFIX: Final = "colocate."
"""The namespace of every colocate attribute key; log lines carry the keys without it."""

# --- instrumentation scopes -------------------------------------------------------------------

LIFECYCLE_SCOPE: Final = "colocate.lifecycle"
"""The tracer of the driver's lifecycle spans (`colocate.step`, `lifecycle.<event>`)."""
TRACER: Final = "colocate"
"""The tracer of every other span: process-side work, the start-up, the engine's HTTP calls."""

# --- span names ---------------------------------------------------------------------------------

STEP_SPAN: Final = "colocate.step"
"""One training step: the root of its trace, on the driver (`Lifecycle.step`)."""
START_SPAN: Final = "colocate.start"
"""The job's start-up, once before the first step: a trace of its own, not a step."""
START_CONNECT_SPAN: Final = "start.connect"
"""Start-up: connecting to the SGLang servers the run is given (none for an engine the job starts)."""
START_CLUSTER_SPAN: Final = "start.cluster"
"""Start-up: the ranks' rendezvous, the Ray cluster (the private one started, or the user's attached) and
its placement group."""
START_RANKS_SPAN: Final = "start.ranks"
"""Start-up: the trainer ranks' processes started and their Megatron models and optimizers built."""
START_ENGINE_SPAN: Final = "start.engine"
"""Start-up: the rollout engine's process started and its model loaded (none for SGLang servers)."""
START_LIFECYCLE_SPAN: Final = "start.lifecycle"
"""Start-up: the ranks' set-up read, the lifecycle built, and the engine's memory taken over."""
CLOSE_SPAN: Final = "colocate.close"
"""The job's close, once after its last step (or a failed start): a trace of its own, as the start-up's;
what it asks of the engine and the processes (SGLang's memory handed back) are its children."""
ENGINE_MATCHES_TRAINER_SPAN: Final = "colocate.engine_matches_trainer"
"""The job's check, after every sync, that the engine serves what the trainer holds."""
LIFECYCLE_PREFIX: Final = "lifecycle."
"""`lifecycle.<event>`: one span per transition, a child of the step (see `lifecycle_span`)."""
RESUME_SPAN: Final = "start.resume"
"""Start-up, `--resume`: every rank loads the checkpoint's model, optimizer and RNG; the run, its sampler and report."""

ROLE_DRIVER: Final = "driver"
"""The process that runs the lifecycle: a value of `colocate.role`."""
ROLE_RANK: Final = "rank"
"""A trainer rank's process: a value of `colocate.role`, and the prefix of its work spans."""
ROLE_ENGINE: Final = "engine"
"""The rollout engine's process: a value of `colocate.role`, and the prefix of its work spans."""
RANK_PREFIX: Final = f"{ROLE_RANK}."
"""`rank.<method>`: a call the driver made on a trainer rank, and the rank's work nested in it."""
ENGINE_PREFIX: Final = f"{ROLE_ENGINE}."
"""`engine.<method>`: a call the driver made on the engine's process."""

BUCKET_SPAN: Final = "rank.bucket"
"""One bucket of a weight push, on the rank that sends it (`colocate.tensors`, `colocate.bytes`)."""
CAST_SPAN: Final = "rank.cast"
"""Rematerialization's cast of the fp32 mains into the bf16 param buffer."""
GATHER_SPAN: Final = "rank.gather"
"""Rematerialization's param all-gather across the data-parallel group."""
EXTRAS_SPAN: Final = "rank.extras"
"""The copy of the extras (buffers, fp32 and frozen params) back from their host backup."""
DIGEST_SPAN: Final = "rank.digest"
"""The digests of a rank's params, to check a restore bit for bit (`colocate.tensors`)."""

# --- span events ----------------------------------------------------------------------------------

GUARD_REJECTED_EVENT: Final = "guard.rejected"
"""On a refused transition's span, one per guard that said no (`colocate.guard`, `colocate.reason`)."""
TABLE_REJECTED_EVENT: Final = "table.rejected"
"""On the span of an event the table has no row for in its phase (`colocate.reason`, `colocate.legal_events`)."""

# --- attributes of every lifecycle span -----------------------------------------------------------

EVENT: Final = "colocate.event"
"""The lifecycle event, as `states.Event` names it (str)."""
SOURCE: Final = "colocate.source"
"""The phase the event left, as `states.Phase` names it (str)."""
DESTINATION: Final = "colocate.destination"
"""The phase the event entered (str), set once entered: absent on a refused or failed event, which entered none."""
STEP: Final = "colocate.step"
"""The training step, from 1 (int); on `colocate.step` spans too."""
RANK: Final = "colocate.rank"
"""The trainer rank (int): on lifecycle spans, on a rank's spans and on its process's resource."""
MODE: Final = "colocate.mode"
"""How the bf16 params survive the rollout, as `states.Mode` names it (str)."""
REFUSED: Final = "colocate.refused"
"""True on the span of an event that a guard or the table refused (bool)."""
GUARD: Final = "colocate.guard"
"""On a `guard.rejected` event: the name of the guard that said no (str)."""
REASON: Final = "colocate.reason"
"""On a `guard.rejected` or `table.rejected` event: why the event was refused (str)."""
LEGAL_EVENTS: Final = "colocate.legal_events"
"""On a `table.rejected` event: the events the table allows in that phase (list of str)."""
CAUSE: Final = "colocate.cause"
"""On the fault transition's span: the error's type and message (str)."""

# --- what the actions moved, on their lifecycle spans ---------------------------------------------

BYTES_STASHED: Final = "colocate.bytes_stashed"
"""pause_grads: bytes of the extras copied to their host backup (bytes)."""
BYTES_FREED: Final = "colocate.bytes_freed"
"""pause_grads, drop_params: bytes the paused regions gave back, as docs/tracing.md counts them (bytes)."""
HOST_ARENA_BYTES: Final = "colocate.host_arena_bytes"
"""rank.setup (GPU): the pinned host arenas laid out at the rank's set-up, for the regions that keep their contents (bytes)."""
HOST_ARENA_SECONDS: Final = "colocate.host_arena_seconds"
"""rank.setup (GPU): how long laying out and pinning those arenas took (seconds)."""
HOST_PINNED_BYTES: Final = "colocate.host_pinned_bytes"
"""pause_grads and restore: pinned host memory the rank holds, its backups (the trainer's stash) and its
regions' host arenas (kept across cycles), in bytes."""
WEIGHT_VERSION: Final = "colocate.weight_version"
"""update_weights, skip_update, recover: the weight version the engine serves afterwards; save: the one
the checkpoint names (int)."""
TENSORS: Final = "colocate.tensors"
"""Tensors handed over: by a weight push on its lifecycle span, by a bucket or a digest (count)."""
BYTES_MOVED: Final = "colocate.bytes_moved"
"""update_weights, skip_update: bytes the weight transport pushed to the engine (bytes)."""
BUCKETS: Final = "colocate.buckets"
"""update_weights, skip_update: buckets the weight transport sent (count)."""
TENSORS_DIGESTED: Final = "colocate.tensors_digested"
"""drop_params, in the first verified cycles: tensors digested to check the restore (count)."""
BYTES_RETAKEN: Final = "colocate.bytes_retaken"
"""restore, recover: bytes the resumed regions took back, counted as `bytes_freed` (bytes)."""
BYTES_REBUILT: Final = "colocate.bytes_rebuilt"
"""restore, recover: bytes of bf16 params written back, by rebuild or from the backup (bytes)."""
BYTES_TO_HOST: Final = "colocate.bytes_to_host"
"""pause_grads: bytes copied to pinned host memory, the stash and the regions' host arenas (bytes)."""
BYTES_FROM_HOST: Final = "colocate.bytes_from_host"
"""restore, recover: bytes copied back from the regions' host arenas (bytes)."""
RECONCILED: Final = "colocate.reconciled"
"""recover: how what the adapters reported differed from TRAIN when it began, or `nothing` (list of str)."""
CHECKPOINT: Final = "colocate.checkpoint"
"""save: the directory of the complete checkpoint it wrote; the resume span: the one it loaded (str)."""
BYTES_WRITTEN: Final = "colocate.bytes_written"
"""save: bytes of the checkpoint's files, every rank's and the driver's (bytes)."""
RESTORE_VERIFIED: Final = "colocate.restore_verified"
"""restore, recover, in verified cycles: the rebuilt params match the drop's digests (bool)."""

BYTES_BY_KIND: Final[Mapping[str, str]] = MappingProxyType(
    {
        "moved": BYTES_MOVED,
        "freed": BYTES_FREED,
        "stashed": BYTES_STASHED,
        "retaken": BYTES_RETAKEN,
        "rebuilt": BYTES_REBUILT,
        "to_host": BYTES_TO_HOST,
        "from_host": BYTES_FROM_HOST,
        "written": BYTES_WRITTEN,
    }
)
"""The byte counts a lifecycle span may carry, by the short name `colocate trace` shows them under."""

# --- process-side spans and resources -------------------------------------------------------------

ROLE: Final = "colocate.role"
"""A process's resource: `driver`, `rank` or `engine` (str)."""
MEMORY_BEFORE: Final = "colocate.memory_before"
"""Every process-side span: the process's resident set size when it began (bytes)."""
MEMORY_AFTER: Final = "colocate.memory_after"
"""Every process-side span: the process's resident set size when it ended (bytes)."""
REGION: Final = "colocate.region"
"""`rank.pause` and `rank.resume`: the memory region the call paused or resumed, as `states.Region` names it (str)."""
BYTES: Final = "colocate.bytes"
"""A process-side call that returns a byte count, or a bucket: the bytes it moved (bytes)."""
ENGINE_MATCHES_TRAINER: Final = "colocate.engine_matches_trainer"
"""On its span of the same name: the engine's weights digest equal to the trainer's (bool)."""


def lifecycle_span(event: Event) -> str:
    """The name of a transition's span: `lifecycle.<event>`."""
    return f"{LIFECYCLE_PREFIX}{event.value}"
