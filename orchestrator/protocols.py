"""The seams colocate drives. Each real component implements one of these Protocols.

The shapes follow the real APIs (docs/lifecycle.md; SGLang's routes in docs/sglang.md):
- `MemoryRegions` is torch_memory_saver's `pause(tag)` / `resume(tag)`: pause returns the physical
  memory and keeps the virtual addresses; resume maps fresh memory whose contents are undefined.
- `Trainer` wraps Megatron-core DDP chunks and their (chained) DistributedOptimizer.
- `RolloutEngine` is SGLang's `/release_memory_occupation`, `/resume_memory_occupation`,
  `/flush_cache` and `/get_weight_version`.
- `WeightTransport` is SGLang's `/update_weights_from_tensor` or `/update_weights_from_distributed`.

Adapters report what they did and never swallow a failed call: the controller decides. Each
also says what is true now (`MemoryRegions.paused`, `RolloutEngine.released`,
`TrainerControl.mains_generation`): a call can fail after it took effect, and `recover` acts on
what these report, not on what the controller believed it did (docs/lifecycle.md, recovery).
Calls are idempotent where the component allows: pausing what is paused, resuming what is
resident, releasing what is released is a no-op that logs a note, never a second effect.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from states import EngineMemory, Mode, TrainerLayout

if TYPE_CHECKING:  # torch stays unimported here: `colocate diagram` runs without it
    import torch

Named: TypeAlias = tuple[str, "torch.Tensor"]
"""A named tensor, as a trainer yields its sync tensors and an engine takes them."""


# ---- what each component reports, in one answer ---------------------------------------------
# The controller asks each component for its state once per event, with one `state()` call, and
# only if the event's guards or action read it (core/state.py). Under Ray that is one round trip
# to each worker.


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionsState:
    """What memory regions report: the tags paused now, and the host bytes pinned for them."""

    paused: frozenset[str]
    host_arena_bytes: int = 0  # pinned once for `default`'s contents, held across cycles; 0 if none


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerState:
    """What the training side reports: how often its mains moved, and what it pins for restores.

    `regions` is set where one object is both the trainer and its memory regions (the job's rank
    group): each rank answers for both in one round trip."""

    mains_generation: int
    host_pinned_bytes: int
    regions: RegionsState | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineState:
    """What a rollout engine reports: the memory released now, whether it is idle, the version it serves."""

    released: frozenset[EngineMemory]
    idle: bool
    weight_version: int | None


@runtime_checkable
class MemoryRegions(Protocol):
    """Tagged regions of device memory whose physical pages can be returned and retaken.

    Tags are `states.Region` values. `param_buffer` and `grad_buffer` are paused without a
    backup: their contents are lost (params are rebuilt, grads are zeroed before use). `default`
    holds the fp32 mains and Adam state and is paused with a CPU backup: its contents survive.

    The controller reads `paused` before it acts and never pauses a paused tag or resumes a
    resident one. Implementations still make both a no-op with a note (torch_memory_saver itself
    exits the process on either), so a fan-out over ranks that disagree can act on every rank.
    """

    def tags(self) -> frozenset[str]:
        """The tags this implementation manages."""
        ...

    @property
    def paused(self) -> frozenset[str]:
        """The tags paused now: read from what the adapter did, so a pause that took effect and
        then raised counts as paused."""
        ...

    def pause(self, tag: str) -> int:
        """Return the tag's physical memory; the contents are lost. Returns the bytes freed."""
        ...

    def resume(self, tag: str) -> int:
        """Map memory for the tag again behind the same tensors (views included). Returns the bytes
        retaken. torch_memory_saver maps the same virtual addresses again; storage resizing
        (`StorageRegions`) allocates new ones, which the tensors follow."""
        ...

    def host_arena_bytes(self) -> int:
        """Pinned host bytes held now for the regions' contents: host copies of what they pause
        (`default`'s), pinned once and held across cycles; 0 for regions that pin nothing."""
        ...

    def state(self) -> RegionsState:
        """`paused` and `host_arena_bytes` in one answer (`RegionsStateFromReads` builds it)."""
        ...


@runtime_checkable
class TrainerControl(Protocol):
    """What the lifecycle calls on the training side: where params live, stash, rebuild, digests.

    `Trainer` adds the tensors a weight sync reads. A trainer whose ranks live in other processes
    (the job's rank group) implements only this: its transport reads inside each rank.
    """

    def layout(self) -> TrainerLayout:
        """Where each synced tensor lives and which params no restore path covers."""
        ...

    def stash(self, mode: Mode) -> int:
        """Copy to pinned host memory what the coming pauses would lose.

        Rematerialize: the extras only (expert_bias buffers, fp32 params, frozen params).
        Backup: the extras and every bf16 param. Returns bytes copied.
        """
        ...

    def rebuild(self, mode: Mode) -> int:
        """Make the params cast(mains) again: after their regions resumed, or after an optimizer
        step stopped midway. Returns bytes written.

        Rematerialize: cast fp32 mains to bf16, all-gather the params, copy the extras back.
        Backup: copy the pinned host copy back. A stash older than the last step (see
        `mains_generation`) is stale: the params are cast from the mains instead, and the extras,
        never dropped since that step (a step runs only with every region resident), stay as they are.
        """
        ...

    def digests(self) -> Mapping[str, str]:
        """A digest per param (and extra buffer), to prove a restore bit-identical."""
        ...

    def host_pinned_bytes(self) -> int:
        """Pinned host bytes this rank holds for restores."""
        ...

    def mains_generation(self) -> int:
        """How many optimizer steps have begun to change the fp32 mains (counted as each begins,
        so a step that raised midway counts). The params are cast(mains) only if they were
        written after the last step began: a change since the controller last saw them whole
        means `rebuild` is due, whatever the controller believed."""
        ...

    def state(self) -> TrainerState:
        """`mains_generation` and `host_pinned_bytes` in one answer (`TrainerStateFromReads`)."""
        ...


@runtime_checkable
class Trainer(TrainerControl, Protocol):
    """The training side in this process: params in DDP buffers, fp32 mains and Adam state in the
    optimizer, and the tensors a weight transport reads.

    `layout()` says where each sync tensor lives, so the lifecycle can refuse a sync that would
    read dropped memory.
    """

    def sync_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every tensor the engine needs, named as `layout().sync_sources` names it.

        **Read-only.** Each tensor is a view of a resident param (valid until the param buffer
        is dropped) or a copy; never the storage a restore reads back from (the extras'
        backup). A transport must not write to them: a write to a view changes the live param
        (a transport can tell: the view's `_version` moves), a write to a copy changes nothing.
        Read them inside `update_weights` only, while the lifecycle holds the params resident.
        """
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineFeatures:
    """What an engine can do beyond the calls every engine answers, declared once by its class
    (`features = EngineFeatures(...)`) and read once, where it is wired: never probed per call."""

    loads_weights: bool = True  # update_weights: a bucket at a time (a transport may feed it instead)
    sessions: bool = False  # takes weights only inside weight_update_session (SGLang 0.5.23)
    footprint: bool = False  # footprint(): each memory tag's bytes, from its own settings
    reports_weights: bool = False  # digests(): every weight's digest (SGLang cannot report its weights in full)


@runtime_checkable
class RolloutEngine(Protocol):
    """The rollout side: what the controller drives (release, resume, flush, its state), and
    what the job and the transports ask of it (weights, generation, digests). What it can do
    beyond the calls every engine answers is its `features`; `EngineDefaults` gives an engine
    the answers of one without them."""

    name: str
    features: EngineFeatures

    def release(self, tags: frozenset[EngineMemory]) -> None:
        """Release the tagged memory (SGLang: /release_memory_occupation). Fails if busy.
        Tags already released are left as they are, with a note."""
        ...

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        """Take the tagged memory back (SGLang: /resume_memory_occupation)."""
        ...

    def released(self) -> frozenset[EngineMemory]:
        """The memory released now. A release or resume that failed after the engine applied it
        (a read timeout) is settled before this answers: it never repeats the engine's own
        belief back as a guess."""
        ...

    def flush_cache(self) -> None:
        """Drop every cache entry computed with older weights (SGLang: /flush_cache)."""
        ...

    def weight_version(self) -> int | None:
        """The version the engine serves, None before any (SGLang: /get_weight_version)."""
        ...

    def is_idle(self) -> bool:
        """True when no request is in flight."""
        ...

    def state(self) -> EngineState:
        """`released`, `is_idle` and `weight_version` in one answer."""
        ...

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """Load one bucket (engine names and layouts); returns the bytes written. Reads the tensors,
        never writes them. It serves `version` once every weight has arrived at that version, or,
        with `features.sessions`, once the session around them closed cleanly."""
        ...

    def weight_update_session(self, version: int | None = None) -> AbstractContextManager[None]:
        """The session around an update, held open from its start until its last bucket and the
        flush, and closed on failure too (SGLang 0.5.23: /begin_weight_update …
        /end_weight_update). The engine serves `version` once the body returned and the session
        closed, never after a body that raised. None leaves the version served as it is. Without
        `features.sessions`, a session that does nothing."""
        ...

    def generate(
        self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Completions of exactly `max_new_tokens` per prompt row, and each token's log-probability."""
        ...

    def footprint(self) -> Mapping[EngineMemory, int] | None:
        """What each memory tag takes while resident, released or not; None without `features.footprint`."""
        ...

    def digests(self) -> dict[str, str] | None:
        """A digest per engine weight; None without `features.reports_weights`."""
        ...


# ---- `state()` from a component's own reads -------------------------------------------------
# For a component in this process each read is a call, not a round trip. A component over
# workers or servers (the job's rank group and replica set) answers `state()` itself, once per
# worker.


class RegionsStateFromReads:
    """`MemoryRegions.state()` from `paused` and `host_arena_bytes` (0 unless overridden)."""

    paused: frozenset[str]

    def host_arena_bytes(self) -> int:
        return 0

    def state(self) -> RegionsState:
        return RegionsState(paused=frozenset(self.paused), host_arena_bytes=self.host_arena_bytes())


class TrainerStateFromReads:
    """`TrainerControl.state()` from `mains_generation` and `host_pinned_bytes`."""

    def state(self: TrainerControl) -> TrainerState:
        return TrainerState(mains_generation=self.mains_generation(), host_pinned_bytes=self.host_pinned_bytes())


class EngineDefaults:
    """What an engine answers for a feature it lacks (`EngineFeatures`), and `state()` from its
    three reads."""

    features = EngineFeatures()

    def state(self: RolloutEngine) -> EngineState:
        return EngineState(released=self.released(), idle=self.is_idle(), weight_version=self.weight_version())

    def weight_update_session(self, version: int | None = None) -> AbstractContextManager[None]:
        return nullcontext()

    def footprint(self) -> Mapping[EngineMemory, int] | None:
        return None

    def digests(self) -> dict[str, str] | None:
        return None

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        raise NotImplementedError(f"{type(self).__name__} loads no weights (features.loads_weights is False)")

    def generate(
        self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not generate")


@dataclass(frozen=True, slots=True)
class TransferReport:
    tensors: int
    bytes: int
    buckets: int


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    """What a save wrote: the complete checkpoint's directory, its files and their bytes."""

    path: str
    files: int
    bytes: int


@runtime_checkable
class Checkpointer(Protocol):
    """Saves a run at the end of the steps it says are due (`Lifecycle(checkpointer=...)`): the
    lifecycle fires `save` then, in TRAIN, under its guards, and the save is that event's work."""

    def due(self, step: int) -> bool:
        """Whether the step that just ended is saved."""
        ...

    def save(self, step: int, weight_version: int) -> SavedCheckpoint:
        """Write the checkpoint of `step`, whose weights the engine serves as `weight_version`.
        It is complete only once this returns: a failure or a kill before leaves the last one."""
        ...


@runtime_checkable
class WeightTransport(Protocol):
    """Moves the trainer's sync tensors into the engine, tagged with a weight version."""

    def push(self, version: int) -> TransferReport:
        """Send every sync tensor; the engine serves `version` once this returns."""
        ...


class BucketSink(Protocol):
    """What a transport writes buckets into: an engine's `update_weights(bucket, version)`, or a
    staging buffer in front of one (`job.workers.staging`)."""

    def update_weights(self, named: Sequence[Named], version: int) -> int: ...
