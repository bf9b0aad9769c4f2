"""Bucketing never splits a tensor, keeps order and reports what moved."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orchestrator.adapters.transport.bucketed import buckets, push_in_buckets
from orchestrator.protocols import Named


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
