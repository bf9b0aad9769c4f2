"""Adapters by name: the one place where a name from a config becomes an adapter.

    regions = REGIONS["cuda"](trainer.region_tensors)      # TorchMemorySaverRegions
    with ENGINES["sglang"].build(spec) as engine: ...       # SGLangGroup, connected, closed after

A registry maps a name to a factory. Each factory imports its adapter when it is called, so that
choosing one costs no import of torch_memory_saver or sglang, and an adapter whose extra is not
installed is refused by name (a `ConfigError`) only when it is chosen. A name nobody registered
is a `ConfigError` naming it and the names that are known. Registering is for a process's
start-up (an import), not per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from orchestrator.core.config import EnginePause
from orchestrator.errors import ConfigError
from orchestrator.protocols import MemoryRegions, RolloutEngine

if TYPE_CHECKING:
    from orchestrator.adapters.regions.storage import TensorsByTag

F = TypeVar("F")


class Registry(Generic[F]):
    """Names → factories for one kind of adapter (`kind` names it in errors: "engine", "device")."""

    __slots__ = ("_factories", "kind")

    def __init__(self, kind: str, factories: Mapping[str, F] | None = None) -> None:
        self.kind = kind
        self._factories: dict[str, F] = dict(factories or {})

    def register(self, name: str, factory: F) -> None:
        """Add `name`; a name already taken is refused rather than silently replaced."""
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._factories[name] = factory

    def __getitem__(self, name: str) -> F:
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise ConfigError([f"unknown {self.kind} {name!r}; known: {known}"]) from None

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._factories))


class OwnedRegions(MemoryRegions, Protocol):
    """A regions adapter as the registry builds it: its host arenas are its own, freed by `close`."""

    def close(self) -> None:
        """Unpin and free the host arenas (a later pause would pin them again)."""
        ...


# Memory regions, by the device a trainer rank trains on.
RegionsFactory = Callable[[Callable[[], "TensorsByTag"]], OwnedRegions]


def _storage_regions(tensors: Callable[[], TensorsByTag]) -> OwnedRegions:
    from orchestrator.adapters.regions.storage import StorageRegions

    return StorageRegions(tensors)


def _tms_regions(tensors: Callable[[], TensorsByTag]) -> OwnedRegions:
    from orchestrator.adapters.regions.tms import TorchMemorySaverRegions

    return TorchMemorySaverRegions(tensors)


REGIONS: Registry[RegionsFactory] = Registry("device", {"cpu": _storage_regions, "cuda": _tms_regions})


# Rollout engines, by the name `colocate run --engine` takes.
@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """What a job asks of its engine: the model and the shape of a rollout; where the engine is
    served apart, its servers' URLs."""

    model: Any  # the trainer's model config (TinyGPTConfig) or a transformers LlamaConfig
    max_batch: int  # rows per rollout
    max_len: int  # prompt plus completion, in tokens
    device: str = "cpu"  # where an engine the job runs itself puts its weights
    name: str = ""  # how spans and errors name it; "" is the kind's own name
    urls: tuple[str, ...] = ()
    timeout_s: float = 120.0  # how long a served engine may take to answer a call
    pause: EnginePause = EnginePause.RETRACT  # how a served engine holds generation around an update


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineAdapter:
    """One kind of rollout engine: how to build it, and where it runs.

    `served`: the engine runs in servers of its own, one URL each, and the job only connects to
    them (`build` in the driver). Otherwise the job runs it in its own processes, a replica beside
    each rank's GPU, and calls `build` there. `build` yields the engine and closes it on the way out.
    """

    build: Callable[[EngineSpec], AbstractContextManager[RolloutEngine]]
    served: bool


@contextlib.contextmanager
def _transformers(spec: EngineSpec) -> Iterator[RolloutEngine]:
    from orchestrator.adapters.engines.transformers import TransformersEngine

    yield TransformersEngine(
        spec.model, max_batch=spec.max_batch, max_len=spec.max_len, device=spec.device, name=spec.name or "transformers"
    )


@contextlib.contextmanager
def _sglang(spec: EngineSpec) -> Iterator[RolloutEngine]:
    try:
        from orchestrator.adapters.engines.sglang import SGLangGroup
    except ImportError as exc:
        raise ConfigError([f"the sglang engine needs the sglang extra (pip install -e '.[sglang]'): {exc}"]) from exc
    group = SGLangGroup(spec.urls, pause=spec.pause, read_timeout_s=spec.timeout_s)
    with contextlib.closing(group):
        group.connect()  # an unreachable server fails here, by its URL
        yield group


ENGINES: Registry[EngineAdapter] = Registry(
    "engine",
    {
        "transformers": EngineAdapter(build=_transformers, served=False),
        "sglang": EngineAdapter(build=_sglang, served=True),
    },
)
