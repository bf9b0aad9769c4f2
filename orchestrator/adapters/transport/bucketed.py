"""Weight sync in buckets, and a `WeightTransport` from a trainer in this process to any engine that takes them.

The trainer's named tensors are converted, grouped by size and pushed. Buckets bound the memory a
sync holds in flight (SGLang's flattened buckets serve the same purpose); a bucket never splits a
tensor. The sync tensors are read at each push (never cached: the lifecycle admits a push only
while the params are resident), converted to the engine's names and layout, and pushed in buckets
of at most `bucket_bytes`. The engine is anything with `update_weights(named, version)`
(`orchestrator.protocols.BucketSink`): `TransformersEngine`, `SGLangEngine`, `SGLangGroup`.

    transport = BucketedTransport(trainer.sync_tensors, engine, convert=partial(to_hf, cfg=model))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from orchestrator.protocols import BucketSink, Named, TransferReport
from orchestrator.telemetry import semconv
from orchestrator.telemetry.tracing import process_span

__all__ = ["BucketedTransport", "buckets", "nbytes", "push_in_buckets"]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets(named: Iterable[Named], bucket_bytes: int) -> Iterator[list[Named]]:
    """Consecutive groups of at most `bucket_bytes` (a larger tensor travels alone)."""
    bucket: list[Named] = []
    size = 0
    for name, tensor in named:
        if bucket and size + nbytes(tensor) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes(tensor)
    if bucket:
        yield bucket


def push_in_buckets(
    named: Iterable[Named],
    sink: BucketSink,
    version: int,
    *,
    bucket_bytes: int,
    convert: Callable[[str, torch.Tensor], list[Named]] = lambda n, t: [(n, t)],
) -> TransferReport:
    """Convert every tensor, bucket the results, push each bucket tagged with `version`."""
    converted = (pair for name, tensor in named for pair in convert(name, tensor))
    tensors = moved = count = 0
    for bucket in buckets(converted, bucket_bytes):
        with process_span(semconv.BUCKET_SPAN, {semconv.TENSORS: len(bucket)}) as span:
            sent = sink.update_weights(bucket, version)
            span.set_attribute(semconv.BYTES, sent)
        moved += sent
        tensors += len(bucket)
        count += 1
    return TransferReport(tensors=tensors, bytes=moved, buckets=count)


def _as_is(name: str, tensor: torch.Tensor) -> list[Named]:
    return [(name, tensor)]


class BucketedTransport:
    """Implements `orchestrator.protocols.WeightTransport` for a trainer and an engine both reachable here.

    `tensors` yields the trainer's named sync tensors (`MegatronTrainer.sync_tensors`); `convert`
    maps one of them to the engine's tensors (`orchestrator.adapters.megatron.convert.to_hf` for a Llama engine).
    """

    def __init__(
        self,
        tensors: Callable[[], Iterable[Named]],
        engine: BucketSink,
        *,
        convert: Callable[[str, torch.Tensor], list[Named]] = _as_is,
        bucket_bytes: int = 1 << 20,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self._tensors, self._engine, self._convert, self._bucket_bytes = tensors, engine, convert, bucket_bytes

    def push(self, version: int) -> TransferReport:
        return push_in_buckets(
            self._tensors(), self._engine, version, bucket_bytes=self._bucket_bytes, convert=self._convert
        )
