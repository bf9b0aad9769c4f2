"""A `WeightTransport` from a trainer in this process to any engine that takes buckets.

The trainer's sync tensors are read at each push (never cached: the lifecycle admits a push only
while the params are resident), converted to the engine's names and layout, and pushed in buckets
of at most `bucket_bytes` (`orchestrator.adapters.transport.buckets.push_in_buckets`). The engine is anything with
`update_weights(named, version)`: `TransformersEngine`, `SGLangEngine`, `SGLangGroup`.

    transport = BucketedTransport(trainer.sync_tensors, engine, convert=partial(to_hf, cfg=model))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from orchestrator.adapters.transport.buckets import BucketSink, Named, push_in_buckets
from orchestrator.protocols import TransferReport

__all__ = ["BucketedTransport"]


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
