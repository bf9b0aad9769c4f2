"""Weight sync in buckets: the trainer's named tensors, converted, grouped by size, pushed.

Buckets bound the memory a sync holds in flight (SGLang's flattened buckets serve the same
purpose); a bucket never splits a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import torch

from orchestrator.protocols import TransferReport
from orchestrator.telemetry.tracing import process_span

Named = tuple[str, torch.Tensor]


class BucketSink(Protocol):
    """What receives buckets: an engine's `update_weights(bucket, version)`."""

    def update_weights(self, named: Sequence[Named], version: int) -> int: ...


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
        with process_span("rank.bucket", {"colocate.tensors": len(bucket)}) as span:
            sent = sink.update_weights(bucket, version)
            span.set_attribute("colocate.bytes", sent)
        moved += sent
        tensors += len(bucket)
        count += 1
    return TransferReport(tensors=tensors, bytes=moved, buckets=count)
