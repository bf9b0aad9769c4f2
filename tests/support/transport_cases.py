"""Every WeightTransport adapter, built small, with what reached its engine (see contract_cases.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator.errors import EngineError
from orchestrator.protocols import Named, RolloutEngine, WeightTransport
from orchestrator.testing import InMemoryEngine, InMemoryTrainer, InMemoryTransport
from states import EngineMemory, Mode
from tests.support.contract_cases import hf_weights, stand_in, tiny_hf_engine


@dataclass
class TransportCase:
    """A transport into an engine. `expected` is what a push must deliver (engine names, engine
    dtypes); `delivered` is what reached the engine since the last `forget`, one entry per tensor
    received (a tensor sent twice appears twice); `sources` are the tensors the push reads."""

    transport: WeightTransport
    engine: RolloutEngine
    expected: Callable[[], dict[str, torch.Tensor]]
    delivered: Callable[[], list[Named]]
    forget: Callable[[], None]
    sources: Callable[[], list[Named]]
    refuse: Callable[[], None]  # make the engine refuse the next push
    refusal: type[Exception]
    calls: Callable[[], int] | None = None  # sink calls (buckets) since `forget`, where countable
    session: Callable[[int], AbstractContextManager[None]] = nullcontext


@dataclass
class Recording:
    """A `BucketSink` in front of an engine: it passes every bucket on and keeps a copy of it."""

    engine: Any
    received: list[Named] = field(default_factory=list)
    buckets: int = 0

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        written = self.engine.update_weights(named, version)
        self.received.extend((n, t.detach().clone()) for n, t in named)
        self.buckets += 1
        return int(written)

    def forget(self) -> None:
        self.received, self.buckets = [], 0


def as_engine_dtypes(named: Sequence[Named], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {n: t.to(params[n].dtype) for n, t in named}


@contextmanager
def in_memory_transport() -> Iterator[TransportCase]:
    trainer, engine = InMemoryTrainer(), InMemoryEngine()
    trainer.stash(Mode.REMATERIALIZE)
    transport = InMemoryTransport(trainer, engine)

    def refuse() -> None:
        transport.fail = True

    yield TransportCase(
        transport,
        engine,
        expected=lambda: {n: t.clone() for n, t in trainer.sync_tensors()},
        delivered=lambda: list(engine.weights.items()),
        forget=lambda: engine.weights.clear(),
        sources=lambda: list(trainer.sync_tensors()),
        refuse=refuse,
        refusal=RuntimeError,
    )


@contextmanager
def bucketed_into_transformers() -> Iterator[TransportCase]:
    from orchestrator.adapters.transport.bucketed import BucketedTransport

    engine = tiny_hf_engine()
    weights = hf_weights(engine.model)
    sink = Recording(engine)
    yield TransportCase(
        BucketedTransport(lambda: weights, sink, bucket_bytes=16 << 10),
        engine,
        expected=lambda: as_engine_dtypes(weights, engine.model),
        delivered=lambda: sink.received,
        forget=sink.forget,
        sources=lambda: weights,
        refuse=lambda: engine.release(frozenset({EngineMemory.WEIGHTS})),
        refusal=EngineError,
        calls=lambda: sink.buckets,
    )


@contextmanager
def bucketed_into_sglang() -> Iterator[TransportCase]:
    """Into an `SGLangEngine` over the stand-in; what arrived is what the stand-in rebuilt from the wire."""
    from orchestrator.adapters.engines.sglang import SGLangEngine
    from orchestrator.adapters.transport.bucketed import BucketedTransport

    with ExitStack() as stack:
        served = stand_in(stack)
        state = served.server.state
        engine = SGLangEngine(served.server.url, connect_timeout_s=1.0, retries=0)
        stack.callback(engine.close)
        weights = hf_weights(state.model.model)

        def delivered() -> list[Named]:
            by_name = state.loaded
            return [(n, by_name[n]) for bucket in state.buckets for n, _, _ in bucket]

        def forget() -> None:
            state.buckets.clear()
            state.loaded.clear()

        yield TransportCase(
            BucketedTransport(lambda: weights, engine, bucket_bytes=16 << 10),
            engine,
            expected=lambda: as_engine_dtypes(weights, state.model.model),
            delivered=delivered,
            forget=forget,
            sources=lambda: weights,
            refuse=lambda: engine.release(frozenset({EngineMemory.WEIGHTS})),
            refusal=EngineError,
            calls=lambda: len(state.buckets),
            session=engine.weight_update_session,
        )
