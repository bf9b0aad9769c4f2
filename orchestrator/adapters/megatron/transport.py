"""A `WeightTransport` from a Megatron trainer in this process into any engine that loads buckets.

Each push reads the trainer's sync tensors (read-only: the Trainer Protocol), hands them to a
*converter*, which turns Megatron names and layouts into the engine's and groups the results into
buckets, and loads the buckets into the engine one at a time, tagged with the version. The
converter owns any gathering. The one `colocate_megatron` wires reads the model itself, gathers
TP shards, PP stages and EP experts (the conversion package's `hf_buckets`), and ignores the sync
tensors it is handed:

    convert = lambda named, *, bucket_bytes: hf_buckets(model, bucket_bytes=bucket_bytes)

At tensor-, pipeline- and expert-parallel size 1 every sync tensor is whole, and `per_tensor` maps
them one by one (`per_tensor(partial(to_hf, cfg=spec))`).

Several ranks, one engine. A gathering converter is a collective: every rank of the model runs it,
but only the sync sources (one rank per pipeline stage, `is_sync_source`) send what it yields;
the others (`source=False`) walk the same buckets and drop them, so the engine receives each
tensor once. With `any_rank` (a collective: did any rank fail?), a push starts and ends with it on
every rank: no source sends before every rank's lifecycle has resumed the engine's weights, no
rank reads the shared engine's version before the last source has sent its last bucket, and a
send that fails on one rank fails the push on every rank (`PeerPushFailed` on the others).

What the transport reads is checked to stay unwritten. Every in-place write to a tensor bumps its
version counter (`Tensor._version`), which all views of one storage share. A push records the
counter of each sync tensor that is a view of a live param (`layout().sync_sources`) and compares
after every bucket: a converter or engine that wrote to a live param raises `SyncTensorWritten`,
naming the tensors, before the next bucket goes out. Extras are handed out as copies, so a write
to one changes nothing and is not checked.

    transport = MegatronTransport(trainer, engine, convert=per_tensor(partial(to_hf, cfg=shape)))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import torch

from orchestrator.adapters.transport.bucketed import buckets
from orchestrator.protocols import BucketSink, Named, Trainer, TransferReport
from orchestrator.telemetry import semconv
from orchestrator.telemetry.tracing import process_span
from states import Source

__all__ = ["Converter", "MegatronTransport", "PeerPushFailed", "SyncTensorWritten", "per_tensor"]


class Converter(Protocol):
    """Megatron's sync tensors → the engine's tensors, grouped in buckets of about `bucket_bytes`
    (a tensor larger than that travels alone). Lazy: the transport loads each bucket before it
    asks for the next, so the converter holds at most one bucket of what it made."""

    def __call__(self, named: Iterable[Named], *, bucket_bytes: int) -> Iterable[Sequence[Named]]: ...


def per_tensor(convert: Callable[[str, torch.Tensor], list[Named]]) -> Converter:
    """A `Converter` from a one-tensor mapping (each Megatron tensor is whole: TP = PP = 1)."""

    def converter(named: Iterable[Named], *, bucket_bytes: int) -> Iterator[list[Named]]:
        return buckets((pair for name, tensor in named for pair in convert(name, tensor)), bucket_bytes)

    return converter


class SyncTensorWritten(RuntimeError):
    """A converter or engine wrote to a sync tensor that is a view of a live param."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        shown = ", ".join(self.names[:5]) + (f" and {len(self.names) - 5} more" if len(self.names) > 5 else "")
        super().__init__(
            f"the weight sync wrote to {len(self.names)} live param(s): {shown}; sync tensors are read-only "
            "(copy before changing one)"
        )


class PeerPushFailed(RuntimeError):
    """Another rank's part of this weight sync failed (its own error is raised there)."""

    def __init__(self) -> None:
        super().__init__("another rank's part of this weight sync failed; its error is raised on that rank")


class _Watched:
    """The sync tensors as they pass to the converter, with the version counter each had."""

    def __init__(self, named: Iterable[Named], views: frozenset[str]) -> None:
        self._named, self._views = named, views
        self.seen: list[tuple[str, torch.Tensor, int]] = []

    def __iter__(self) -> Iterator[Named]:
        for name, tensor in self._named:
            if name in self._views:
                self.seen.append((name, tensor, tensor._version))
            yield name, tensor

    def check(self) -> None:
        written = [name for name, tensor, version in self.seen if tensor._version != version]
        if written:
            raise SyncTensorWritten(written)


class MegatronTransport:
    """Implements `orchestrator.protocols.WeightTransport` from a `Trainer` here into an engine that
    loads buckets (`BucketSink`: `TransformersEngine`, `SGLangEngine`, `SGLangGroup`).

    `convert` is the converter (see the module docstring); `bucket_bytes` bounds each bucket.
    `source` is whether this rank sends (see the module docstring: a rank that is not a source
    runs the converter for its collectives and sends nothing, reporting 0 tensors). `any_rank`
    is a collective over the ranks sharing the engine: `any_rank(flag)` is whether any of them
    passed True.

    A push raises what the converter or engine raised (a name it cannot map, a shape the engine
    refuses), or `SyncTensorWritten`; the lifecycle then faults, with the engine serving no new
    version. With `any_rank`, a rank whose send fails (the engine's error, `SyncTensorWritten`)
    stops sending but still walks the converter to its end, so the other ranks' collectives
    complete; then every rank raises: that rank its own error, the others `PeerPushFailed`.
    A converter that raises (its own collectives broken) leaves the other ranks waiting in their
    next collective until torch.distributed's timeout.
    """

    def __init__(
        self,
        trainer: Trainer,
        engine: BucketSink,
        *,
        convert: Converter,
        bucket_bytes: int = 64 << 20,
        source: bool = True,
        any_rank: Callable[[bool], bool] | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self._trainer, self._engine, self._convert, self._bucket_bytes = trainer, engine, convert, bucket_bytes
        self.source, self._any_rank = source, any_rank
        kinds = trainer.layout().sync_sources
        self._views = frozenset(name for name, kind in kinds.items() if kind is Source.PARAM_BUFFER)

    def push(self, version: int) -> TransferReport:
        if self._any_rank is not None:
            self._any_rank(False)  # every rank has resumed the engine's weights
        watched = _Watched(self._trainer.sync_tensors(), self._views)
        tensors = moved = count = 0
        failure: Exception | None = None
        for bucket in self._convert(watched, bucket_bytes=self._bucket_bytes):
            if failure is not None:
                continue  # walked for the other ranks' collectives
            try:
                if self.source:
                    with process_span(semconv.BUCKET_SPAN, {semconv.TENSORS: len(bucket)}) as span:
                        sent = self._engine.update_weights(bucket, version)
                        span.set_attribute(semconv.BYTES, sent)
                    moved += sent
                    tensors += len(bucket)
                    count += 1
                watched.check()
            except Exception as error:
                if self._any_rank is None:
                    raise
                failure = error
        if failure is None:
            try:
                watched.check()  # a write while the converter read its last tensors
            except Exception as error:
                if self._any_rank is None:
                    raise
                failure = error
        if self._any_rank is not None and self._any_rank(failure is not None):  # every source has sent
            raise failure if failure is not None else PeerPushFailed()
        return TransferReport(tensors=tensors, bytes=moved, buckets=count)
