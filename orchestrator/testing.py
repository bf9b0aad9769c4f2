"""In-memory adapters for unit tests of the controller and its overhead benchmark, nothing else.

They keep the contracts of the real adapters (bytes reported, contents lost on a pause without
backup, a double pause fatal as in torch_memory_saver) with a few tensors and no device. The
CLI and the end-to-end tests never use them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from orchestrator.protocols import (
    EngineDefaults,
    EngineFeatures,
    RegionsStateFromReads,
    TrainerStateFromReads,
    TransferReport,
)
from orchestrator.telemetry.logs import note_noop
from states import EngineMemory, Mode, Region, Source, TrainerLayout


class InMemoryRegions(RegionsStateFromReads):
    """Regions of fixed sizes. A pause of a paused tag, or a resume of a resident one, is a no-op
    with a note, as in the real adapters (which stand between it and torch_memory_saver's exit)."""

    def __init__(
        self, sizes: Mapping[str, int] | None = None, on_pause: Mapping[str, Callable[[], None]] | None = None
    ) -> None:
        self.sizes = dict(sizes or {r.value: 1 << 20 for r in Region})
        self.on_pause = dict(on_pause or {})  # what losing a tag's contents does to its tensors
        self._paused: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def tags(self) -> frozenset[str]:
        return frozenset(self.sizes)

    @property
    def paused(self) -> frozenset[str]:
        return frozenset(self._paused)

    def pause(self, tag: str) -> int:
        self.calls.append(("pause", tag))
        if tag in self._paused:
            note_noop("in-memory regions", f"pause({tag})", "already paused")
            return 0
        self._paused.add(tag)
        if tag in self.on_pause:
            self.on_pause[tag]()
        return self.sizes[tag]

    def resume(self, tag: str) -> int:
        self.calls.append(("resume", tag))
        if tag not in self._paused:
            note_noop("in-memory regions", f"resume({tag})", "not paused")
            return 0
        self._paused.discard(tag)
        return self.sizes[tag]


@dataclass
class InMemoryTrainer(TrainerStateFromReads):
    """bf16 params rebuilt from fp32 mains; `extra` is a stand-in for an expert_bias buffer."""

    mains: dict[str, torch.Tensor] = field(
        default_factory=lambda: {f"layer{i}.weight": torch.randn(4, 4) for i in range(2)}
    )
    extra: torch.Tensor = field(default_factory=lambda: torch.zeros(4))
    uncovered: tuple[str, ...] = ()
    corrupt_next_rebuild: str | None = None  # flip one bit of this param at the next rebuild

    def __post_init__(self) -> None:
        self.params = {name: main.to(torch.bfloat16) for name, main in self.mains.items()}
        self._extra_backup: torch.Tensor | None = None
        self._param_backup: dict[str, torch.Tensor] = {}
        self._generation = 0  # optimizer steps begun
        self._stashed_at: int | None = None  # the generation the stash was taken at

    def optimizer_step(self) -> None:
        self.move_mains()
        for name, main in self.mains.items():
            self.params[name].copy_(main)
        self.extra.add_(1)

    def move_mains(self) -> None:
        """The first half of a step: the mains move; the params are written after."""
        self._generation += 1
        for main in self.mains.values():
            main.add_(0.01)

    def mains_generation(self) -> int:
        return self._generation

    def drop(self) -> None:
        """What pausing `param_buffer` does to the contents: they are gone."""
        for p in self.params.values():
            p.fill_(float("nan"))

    def layout(self) -> TrainerLayout:
        sources = {name: Source.PARAM_BUFFER for name in self.params} | {"router.expert_bias": Source.EXTRAS}
        param_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        return TrainerLayout(
            sync_sources=sources,
            uncovered=self.uncovered,
            param_bytes=param_bytes,
            extras_bytes=self.extra.numel() * self.extra.element_size(),
        )

    def stash(self, mode: Mode) -> int:
        self._extra_backup = self.extra.clone()
        if mode is Mode.BACKUP:
            self._param_backup = {n: p.clone() for n, p in self.params.items()}
        self._stashed_at = self._generation
        return self.host_pinned_bytes()

    def rebuild(self, mode: Mode) -> int:
        current = self._stashed_at == self._generation  # else a step began since: the stash is stale
        if mode is Mode.BACKUP and current:
            for name, p in self.params.items():
                p.copy_(self._param_backup[name])
        else:
            for name, p in self.params.items():
                p.copy_(self.mains[name])
        if self._extra_backup is not None and current:
            self.extra.copy_(self._extra_backup)
        if self.corrupt_next_rebuild:
            self.params[self.corrupt_next_rebuild].view(torch.int16).view(-1)[0] ^= 1
            self.corrupt_next_rebuild = None
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def digests(self) -> Mapping[str, str]:
        named = {**self.params, "router.expert_bias": self.extra}
        return {
            # A copy goes to numpy: numpy's view would pin the storage's size (StorageRegions resizes it).
            n: hashlib.sha256(t.view(torch.uint8).clone().numpy().tobytes()).hexdigest()
            for n, t in named.items()
        }

    def sync_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.params.items()
        if self._extra_backup is not None:
            yield "router.expert_bias", self._extra_backup.clone()  # read-only: never the backup itself

    def host_pinned_bytes(self) -> int:
        backups = [*self._param_backup.values(), *([self._extra_backup] if self._extra_backup is not None else [])]
        return sum(t.numel() * t.element_size() for t in backups)


class InMemoryEngine(EngineDefaults):
    """An engine that holds a state dict. `busy` is a test knob.

    Like SGLang and the transformers engine, releasing `weights` loses their contents: it
    serves nothing again until a push has refilled them.
    """

    name = "in-memory"
    features = EngineFeatures(loads_weights=False)  # its transport writes its state dict (InMemoryTransport)

    def __init__(self) -> None:
        self.resident: set[EngineMemory] = set(EngineMemory)
        self.weights: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.busy = False
        self.flushes = 0
        self.calls: list[str] = []

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self.calls.append(f"release:{','.join(sorted(tags))}")
        if self.busy:
            raise RuntimeError("release while requests are in flight")
        if tags - self.resident:
            note_noop(self.name, "release", f"{', '.join(sorted(tags - self.resident))} already released")
        if EngineMemory.WEIGHTS in tags & self.resident:
            self.weights = {}
        self.resident -= tags

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self.calls.append(f"resume:{','.join(sorted(tags))}")
        if tags & self.resident:
            note_noop(self.name, "resume", f"{', '.join(sorted(tags & self.resident))} not released")
        self.resident |= tags

    def released(self) -> frozenset[EngineMemory]:
        return frozenset(EngineMemory) - self.resident

    def flush_cache(self) -> None:
        self.flushes += 1

    def weight_version(self) -> int | None:
        return self.version

    def is_idle(self) -> bool:
        return not self.busy

    def generate(self) -> int | None:  # type: ignore[override]
        """Serve a rollout; returns the version served. Refuses what a real engine would."""
        if self.busy:
            raise RuntimeError("generate while another rollout is in flight")
        missing = set(EngineMemory) - self.resident
        if missing:
            raise RuntimeError(f"generate with {', '.join(sorted(missing))} released")
        if not self.weights or self.version is None:
            raise RuntimeError("generate with no weights loaded since they were released")
        return self.version


class InMemoryTransport:
    def __init__(self, trainer: InMemoryTrainer, engine: InMemoryEngine, *, fail: bool = False) -> None:
        self.trainer, self.engine, self.fail = trainer, engine, fail

    def push(self, version: int) -> TransferReport:
        if self.fail:
            raise RuntimeError("update_weights_from_tensor returned success=false")
        if EngineMemory.WEIGHTS not in self.engine.resident:
            raise RuntimeError("write into released engine weights")
        tensors = dict(self.trainer.sync_tensors())
        self.engine.weights = {n: t.clone() for n, t in tensors.items()}
        self.engine.version = version
        return TransferReport(
            tensors=len(tensors), bytes=sum(t.numel() * t.element_size() for t in tensors.values()), buckets=1
        )
