"""Bucketing never splits a tensor, keeps order and reports what moved."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from orchestrator.adapters.transport.bucketed import buckets, push_in_buckets
from orchestrator.protocols import Named, TransferReport


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


def _megatron_push(
    source: bool, *, engine_fails: bool = False, another_rank_fails: bool = False
) -> tuple[list[str], TransferReport | Exception]:
    """A MegatronTransport over the in-memory trainer; what its converter (a collective every rank
    joins), the engine and the ranks' vote did, in order; and the push's report or error."""
    from orchestrator.adapters.megatron.transport import MegatronTransport
    from orchestrator.testing import InMemoryTrainer

    events: list[str] = []

    class Recording(Sink):
        def update_weights(self, named: Sequence[Named], version: int) -> int:
            events.append(f"send {','.join(n for n, _ in named)}")
            if engine_fails:
                raise ValueError("engine refused the bucket")
            return super().update_weights(named, version)

    def convert(named: object, *, bucket_bytes: int) -> Iterator[list[Named]]:
        for name in ("a", "b"):
            events.append(f"gather {name}")
            yield [(name, torch.zeros(2))]

    def any_rank(failed: bool) -> bool:
        events.append(f"any_rank({failed})")
        return failed or (another_rank_fails and events.count("gather b") > 0)

    transport = MegatronTransport(InMemoryTrainer(), Recording(), convert=convert, source=source, any_rank=any_rank)
    try:
        return events, transport.push(3)
    except Exception as error:
        return events, error


def test_a_rank_that_is_no_sync_source_joins_every_gather_and_sends_nothing() -> None:
    events, report = _megatron_push(source=False)
    assert events == ["any_rank(False)", "gather a", "gather b", "any_rank(False)"]
    assert isinstance(report, TransferReport) and (report.tensors, report.bytes, report.buckets) == (0, 0, 0)


def test_a_sync_source_sends_between_the_votes() -> None:
    events, report = _megatron_push(source=True)
    assert events == ["any_rank(False)", "gather a", "send a", "gather b", "send b", "any_rank(False)"]
    assert isinstance(report, TransferReport) and (report.tensors, report.buckets) == (2, 2)


def test_a_failed_send_still_joins_every_gather_then_fails_every_rank() -> None:
    from orchestrator.adapters.megatron.transport import PeerPushFailed

    events, error = _megatron_push(source=True, engine_fails=True)
    assert events == ["any_rank(False)", "gather a", "send a", "gather b", "any_rank(True)"]
    assert isinstance(error, ValueError) and "engine refused" in str(error)
    events, error = _megatron_push(source=False, another_rank_fails=True)  # the same push, seen from a peer
    assert events == ["any_rank(False)", "gather a", "gather b", "any_rank(False)"]
    assert isinstance(error, PeerPushFailed)
