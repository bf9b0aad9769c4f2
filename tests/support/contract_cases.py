"""Every adapter of MemoryRegions and RolloutEngine, built small, with what its contract tests need to observe it.

A *case* holds an adapter and the test's own view of it: memory measured outside the adapter
(process RSS, the device's free memory), a way to make an engine busy, the tensors a push must
deliver. `tests/support/transport_cases.py` holds the WeightTransport ones, `tests/support/contracts.py`
the checks; `tests/contracts/test_protocol_contracts.py` runs each check over each case. A factory is a context manager: servers stop, engines close.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator.errors import EngineError
from orchestrator.protocols import MemoryRegions, Named, RolloutEngine, WeightTransport
from orchestrator.testing import InMemoryEngine, InMemoryRegions, InMemoryTrainer, InMemoryTransport
from states import EngineMemory, Mode, Region

MiB = 1 << 20
NO_BACKUP = (Region.PARAM_BUFFER.value, Region.GRAD_BUFFER.value)  # contents lost at a pause


# ---- MemoryRegions ------------------------------------------------------------------------------


@dataclass
class RegionsCase:
    """`free()` is what the memory the regions live in has free, measured outside the adapter;
    two readings agree to `tolerance` bytes when nothing changed. `tensors` are the tensors under
    each tag (the first one of a tag is its buffer; the others may be views of it)."""

    regions: MemoryRegions
    tensors: dict[str, list[torch.Tensor]]
    free: Callable[[], int]
    tolerance: int
    grows: bool = False  # calls back for its tensors at every pause: tensors added later are paused too
    keeps_addresses: bool = True  # resume maps the same virtual addresses (see MemoryRegions.resume)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _filled(nbytes: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A tensor of `nbytes` whose every page is written (resident), not all one value."""
    tensor = torch.full((nbytes // dtype.itemsize,), 1.5, dtype=dtype, device=device)
    tensor[::4099] = torch.arange(len(tensor[::4099]), device=device).remainder(251).to(dtype)
    return tensor


def _tagged(size: int, device: str = "cpu") -> dict[str, list[torch.Tensor]]:
    params = _filled(size, torch.bfloat16, device)
    return {
        Region.PARAM_BUFFER.value: [params, params[7:99]],  # a param is a view of the buffer
        Region.GRAD_BUFFER.value: [_filled(size, torch.float32, device)],
        Region.DEFAULT.value: [_filled(size, torch.float32, device), _filled(size // 2, torch.float32, device)],
    }


@contextmanager
def in_memory_regions() -> Iterator[RegionsCase]:
    tensors = _tagged(4096)
    sizes = {tag: sum(t.untyped_storage().nbytes() for t in ts[:1]) for tag, ts in tensors.items()}

    def loses(tag: str) -> Callable[[], None]:
        def lose() -> None:  # what a pause without backup does to the contents
            tensors[tag][0].fill_(float("nan"))

        return lose

    regions = InMemoryRegions(sizes, on_pause={tag: loses(tag) for tag in NO_BACKUP})
    yield RegionsCase(
        regions, tensors, free=lambda: -sum(sizes[t] for t in sizes if t not in regions.paused), tolerance=0
    )


@contextmanager
def storage_regions() -> Iterator[RegionsCase]:
    from orchestrator.adapters.regions.storage import StorageRegions

    tensors: dict[str, list[torch.Tensor]] = {}
    regions = StorageRegions(lambda: tensors)
    tensors.update(_tagged(16 * MiB))
    yield RegionsCase(regions, tensors, free=lambda: -_rss(), tolerance=2 * MiB, grows=True, keeps_addresses=False)


@contextmanager
def tms_regions() -> Iterator[RegionsCase]:
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("torch_memory_saver needs a CUDA device")
    pytest.importorskip("torch_memory_saver")
    from orchestrator.adapters.regions.tms import TorchMemorySaverRegions

    tensors = _tagged(64 * MiB, "cuda")
    regions = TorchMemorySaverRegions(lambda: tensors)

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    try:
        yield RegionsCase(regions, tensors, free=free, tolerance=4 * MiB, grows=True)
    finally:  # a case that failed midway must not leave this process's regions paused for the next
        for tag in regions.paused:
            regions.resume(tag)
        regions.close()


# ---- RolloutEngine ------------------------------------------------------------------------------


@dataclass
class EngineCase:
    """An engine with a transport that fills it (`load`), a rollout (`serve`), a way to run a
    check while a request is in flight (`while_busy`), and the error its refusals raise."""

    engine: RolloutEngine
    transport: WeightTransport
    serve: Callable[[], Any]
    while_busy: Callable[[Callable[[], None]], None]
    refusal: type[Exception]
    weights: Sequence[Named] = ()  # what the transport pushes, in the engine's names ([] if it reads a trainer)
    kill: Callable[[], None] | None = None  # make the engine unreachable (a server that died)
    replicas: int = 1  # servers a bucket goes to (each counts the bytes it was sent)
    # Remote engines: what the servers themselves released (every server's, for a group), and a
    # way to lose the answer to the next memory call on every server (the stand-in's `fault`).
    truth: Callable[[], frozenset[EngineMemory]] | None = None
    fault: Callable[[str, float], None] | None = None

    def session(self, version: int) -> AbstractContextManager[None]:
        engine = self.engine
        return engine.weight_update_session(version)

    def load(self, version: int) -> None:
        """A complete sync, as the lifecycle's update makes it: inside the engine's session."""
        with self.session(version):
            self.transport.push(version)
            self.engine.flush_cache()


@contextmanager
def in_memory_engine() -> Iterator[EngineCase]:
    trainer, engine = InMemoryTrainer(), InMemoryEngine()
    trainer.stash(Mode.REMATERIALIZE)  # the extra is synced from its stash

    def while_busy(check: Callable[[], None]) -> None:
        engine.busy = True
        try:
            check()
        finally:
            engine.busy = False

    yield EngineCase(engine, InMemoryTransport(trainer, engine), engine.generate, while_busy, RuntimeError)


def hf_weights(model: torch.nn.Module, seed: int = 0) -> list[Named]:
    """Values for every param of an HF model, scaled so activations stay O(1)."""
    generator = torch.Generator().manual_seed(seed)
    weights = []
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=generator)
        values = 1 + 0.2 * values if param.dim() == 1 else values / param.shape[-1] ** 0.5
        weights.append((name, values.to(param.dtype)))
    return weights


def tiny_hf_engine(name: str = "transformers") -> Any:
    from orchestrator.adapters.engines.transformers import TransformersEngine
    from orchestrator.adapters.megatron.gpt import TinyGPTConfig

    return TransformersEngine(TinyGPTConfig(), max_batch=4, max_len=16, device="cpu", name=name)


PROMPTS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int64)


@contextmanager
def transformers_engine() -> Iterator[EngineCase]:
    from orchestrator.adapters.transport.bucketed import BucketedTransport

    engine = tiny_hf_engine()
    weights = hf_weights(engine.model)

    def serve() -> Any:
        return engine.generate(PROMPTS, max_new_tokens=2, temperature=1.0, seed=0)

    def while_busy(check: Callable[[], None]) -> None:
        """`check` runs inside the rollout's first forward: a request is in flight then."""
        failures: list[BaseException] = []

        def hook(*_: object) -> None:
            handle.remove()
            try:
                check()
            except BaseException as exc:  # raised once the rollout returned
                failures.append(exc)

        handle = engine.model.register_forward_pre_hook(hook)
        try:
            serve()
        finally:
            handle.remove()
        if failures:
            raise failures[0]

    transport = BucketedTransport(lambda: weights, engine, bucket_bytes=16 << 10)
    yield EngineCase(engine, transport, serve, while_busy, EngineError, weights)


@dataclass
class Served:
    server: Any
    stopped: bool = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.__exit__(None, None, None)

    def die(self, client: Any) -> Callable[[], None]:
        """Stop the server, and drop `client`'s kept-alive connections to it, as a dead
        process's would be (the stand-in's handler threads would otherwise still answer them)."""

        def die() -> None:
            self.stop()
            client.close()

        return die


def stand_in(stack: ExitStack) -> Served:
    """The SGLang stand-in serving a tiny transformers model: it loads, releases and samples for real."""
    from tests.support.sglang_server import SGLangStandIn

    model = tiny_hf_engine()
    names = {name: (tuple(p.shape), p.dtype) for name, p in model.model.named_parameters()}
    served = Served(SGLangStandIn(weights=names, model=model).__enter__())
    stack.callback(served.stop)
    return served


READ_TIMEOUT_S = 2.0  # the SGLang cases' read timeout: a fault answers later than this


def _truth(servers: Sequence[Served]) -> Callable[[], frozenset[EngineMemory]]:
    def truth() -> frozenset[EngineMemory]:
        dead = [s.server.state.dead for s in servers if s.server.state.dead]
        assert not dead, f"a server ended: {dead}"
        return frozenset.intersection(*(frozenset(map(EngineMemory, s.server.state.released)) for s in servers))

    return truth


def _fault(servers: Sequence[Served]) -> Callable[[str, float], None]:
    def fault(kind: str, seconds: float) -> None:
        for s in servers:
            s.server.state.fault = (kind, seconds)

    return fault


def _stand_in_busy(servers: Sequence[Served]) -> Callable[[Callable[[], None]], None]:
    def while_busy(check: Callable[[], None]) -> None:
        for s in servers:
            s.server.hold(requests=1, polls=1 << 30)
        try:
            check()
        finally:
            for s in servers:
                s.server.hold(requests=0, polls=0)

    return while_busy


@contextmanager
def sglang_engine() -> Iterator[EngineCase]:
    from orchestrator.adapters.engines.sglang import SGLangEngine
    from orchestrator.adapters.transport.bucketed import BucketedTransport

    with ExitStack() as stack:
        served = stand_in(stack)
        engine = SGLangEngine(
            served.server.url,
            connect_timeout_s=1.0,
            read_timeout_s=READ_TIMEOUT_S,
            retries=0,
            flush_max_wait_s=1.0,
            flush_poll_s=0.01,
        )
        stack.callback(engine.close)
        weights = hf_weights(served.server.state.model.model)
        transport = BucketedTransport(lambda: weights, engine, bucket_bytes=16 << 10)
        serve = lambda: engine.generate(PROMPTS.tolist(), {"max_new_tokens": 2, "temperature": 1.0})  # noqa: E731
        yield EngineCase(
            engine,
            transport,
            serve,
            _stand_in_busy([served]),
            EngineError,
            weights,
            served.die(engine),
            truth=_truth([served]),
            fault=_fault([served]),
        )


@contextmanager
def sglang_group() -> Iterator[EngineCase]:
    from orchestrator.adapters.engines.sglang import SGLangGroup
    from orchestrator.adapters.transport.bucketed import BucketedTransport

    with ExitStack() as stack:
        servers = [stand_in(stack), stand_in(stack)]
        group = SGLangGroup(
            [s.server.url for s in servers],
            connect_timeout_s=1.0,
            read_timeout_s=READ_TIMEOUT_S,
            retries=0,
            flush_max_wait_s=1.0,
            flush_poll_s=0.01,
        )
        stack.callback(group.close)
        group.connect()
        weights = hf_weights(servers[0].server.state.model.model)
        transport = BucketedTransport(lambda: weights, group, bucket_bytes=16 << 10)

        def serve() -> Any:
            return group.generate(PROMPTS, max_new_tokens=2, temperature=1.0, seed=0)

        yield EngineCase(
            group,
            transport,
            serve,
            _stand_in_busy(servers),
            EngineError,
            weights,
            servers[1].die(group.engines[1]),
            2,
            truth=_truth(servers),
            fault=_fault(servers),
        )
