"""Bucketing never splits a tensor, keeps order and reports what moved."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from orchestrator.protocols import TransferReport
from orchestrator.transport import Named, buckets, push_in_buckets


def test_buckets_respect_the_size_and_keep_order() -> None:
    named = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([10, 10, 30, 5, 5])]
    groups = [[name for name, _ in bucket] for bucket in buckets(named, bucket_bytes=40)]
    assert groups == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_a_tensor_larger_than_a_bucket_travels_alone() -> None:
    named = [("big", torch.zeros(100)), ("small", torch.zeros(1))]
    assert [len(b) for b in buckets(named, bucket_bytes=8)] == [1, 1]


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        self.calls.append(([n for n, _ in named], version))
        return sum(t.numel() * t.element_size() for _, t in named)


def test_push_converts_buckets_and_reports() -> None:
    sink = Sink()
    split = lambda name, t: [(f"{name}.a", t[:2]), (f"{name}.b", t[2:])]  # noqa: E731
    report = push_in_buckets([("w", torch.zeros(4))], sink, 7, bucket_bytes=8, convert=split)
    assert sink.calls == [(["w.a"], 7), (["w.b"], 7)]
    assert (report.tensors, report.bytes, report.buckets) == (2, 16, 2)


def _megatron_push(source: bool) -> tuple[list[str], TransferReport]:
    """A MegatronTransport over the in-memory trainer, its converter and barrier recording the
    order of what they do, and the engine's loads."""
    from orchestrator.adapters.megatron_transport import MegatronTransport
    from orchestrator.inmemory import InMemoryTrainer

    events: list[str] = []

    class Recording(Sink):
        def update_weights(self, named: Sequence[Named], version: int) -> int:
            events.append(f"send {','.join(n for n, _ in named)}")
            return super().update_weights(named, version)

    def convert(named: object, *, bucket_bytes: int) -> Iterator[list[Named]]:
        for name in ("a", "b"):
            events.append(f"gather {name}")  # a collective every rank must join
            yield [(name, torch.zeros(2))]

    transport = MegatronTransport(
        InMemoryTrainer(), Recording(), convert=convert, source=source, barrier=lambda: events.append("barrier")
    )
    report = transport.push(3)
    return events, report


def test_a_rank_that_is_no_sync_source_joins_every_gather_and_sends_nothing() -> None:
    events, report = _megatron_push(source=False)
    assert events == ["barrier", "gather a", "gather b", "barrier"]
    assert (report.tensors, report.bytes, report.buckets) == (0, 0, 0)


def test_a_sync_source_sends_between_the_barriers() -> None:
    events, report = _megatron_push(source=True)
    assert events == ["barrier", "gather a", "send a", "gather b", "send b", "barrier"]
    assert (report.tensors, report.buckets) == (2, 2)
