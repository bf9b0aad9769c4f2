"""A rank's side of the SGLang push with one payload per TP rank (`fanout.PerTpRankPush`).

SGLang's TP rank i unpickles entry i of a bucket's payloads alone and maps the memory that entry
names (a CUDA IPC handle on a GPU, a shared-memory file on the CPU). Colocated, the entry of the
TP rank on trainer rank r's GPU is serialized by rank r, from its own memory. Every rank holds
every weight (data-parallel) and cuts the same buckets in the same order (`bucketed.buckets` is
deterministic given the bucket size), so the driver walks every rank through them together, one
bucket at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from orchestrator.adapters.transport.bucketed import buckets
from orchestrator.protocols import Named
from orchestrator.telemetry import semconv
from orchestrator.telemetry.tracing import process_span


@dataclass(frozen=True, slots=True)
class SerializedBucket:
    """One bucket as one rank serialized it: `payload` is SGLang's wire format of the flattened
    bucket (`wire.serialize(wire.flattened_bucket(...))`), naming this rank's memory."""

    payload: str
    tensors: int
    bytes: int  # of the flattened tensor


class PayloadSource:
    """A worker's buckets as SGLang payloads, one per `next_payload`, between `start_payloads`
    and `end_payloads`. The last bucket's flattened tensor is held until the next call: its
    payload names that memory, which stays valid only while this process holds it."""

    _buckets: Iterator[list[Named]] | None = None
    _held: torch.Tensor | None = None

    def converted(self) -> Iterator[Named]:
        """The HF-named weights to send (`TrainerRank.converted`)."""
        raise NotImplementedError

    def start_payloads(self, bucket_bytes: int) -> None:
        """Begin a walk over `converted()` in buckets of at most `bucket_bytes` (`bucketed.buckets`)."""
        self._buckets, self._held = buckets(self.converted(), bucket_bytes), None

    def next_payload(self) -> SerializedBucket | None:
        """The walk's next bucket, flattened and serialized here; None after the last. The bucket
        before it is let go first."""
        from orchestrator.adapters.engines.sglang.wire import flattened_bucket, serialize

        if self._buckets is None:
            raise RuntimeError("next_payload before start_payloads")
        self._held = None
        bucket = next(self._buckets, None)
        if bucket is None:
            return None
        with process_span(semconv.BUCKET_SPAN, {semconv.TENSORS: len(bucket)}) as span:
            flat = flattened_bucket(bucket)
            payload = serialize(flat)
            self._held = flat["flattened_tensor"]
            span.set_attribute(semconv.BYTES, self._held.numel())
        return SerializedBucket(payload, len(bucket), self._held.numel())

    def end_payloads(self) -> None:
        """End the walk, and let go of the bucket it held."""
        self._buckets = self._held = None
