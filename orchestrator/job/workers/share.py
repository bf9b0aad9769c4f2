"""What one trainer rank is of the layout (`RankShare`), and the HF weights it converts.

At data parallelism only, every rank holds every weight, and rank 0 alone sends them: the job
converts its params one by one (`convert.to_hf`). Where a rank holds only part of the model (TP
or EP above 1), the conversion gathers the other parts with `convert.hf_buckets`, as
`colocate_megatron` does: its gathers are all-gathers, collectives every rank of the model joins
in the same order, after which every rank holds every weight whole; only the sync sources
(`convert.is_sync_source`: tensor-, data- and context-parallel rank 0; one rank while PP is 1)
send them, so the engine receives each HF tensor once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from orchestrator.protocols import BucketSink, Named, TransferReport

# What the gathering conversion holds at once beyond the params (`hf_buckets`' bucket): the
# push cuts its own buckets from the tensors it is handed.
GATHER_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class RankShare:
    """This rank's place in Megatron's parallel state: its data-parallel index and size (the rows
    of a batch it trains on), whether its conversion gathers (TP or EP above 1), and whether it
    sends what it converts (a sync source)."""

    dp_rank: int = 0
    dp_size: int = 1
    gathers: bool = False
    source: bool = True

    @classmethod
    def current(cls) -> RankShare:
        """This rank's share, read from megatron's parallel state (initialized)."""
        from megatron.core import parallel_state as ps

        from orchestrator.adapters.megatron.convert import is_sync_source

        tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        return cls(
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            gathers=tp * ep * ps.get_pipeline_model_parallel_world_size() > 1,
            source=is_sync_source(),
        )

    def converted(self, trainer: Any, chunks: list[Any], shape: Any) -> Iterator[Named]:
        """Every weight the engine loads, as HF names it, whole; not the MTP layers (no engine here
        serves them). Gathering (TP, EP), a collective: every rank must walk it to its end."""
        from orchestrator.adapters.megatron.convert import hf_buckets, to_hf
        from orchestrator.adapters.megatron.convert.mtp import is_mtp

        if self.gathers:
            for bucket in hf_buckets(chunks, bucket_bytes=GATHER_BUCKET_BYTES):  # the MTP layers left out
                yield from bucket
            return
        for name, tensor in trainer.sync_tensors():
            if not is_mtp(name):
                yield from to_hf(name, tensor, shape)

    def join_only(self, named: Iterator[Named]) -> bool:
        """Whether this rank sends nothing of `named`: a rank that is no sync source walks a
        gathering conversion through (its part of the collectives) and drops what it yields; at
        DP only, it has nothing to walk. True for such a rank, once done; False for a source."""
        if self.source:
            return False
        if self.gathers:
            for _ in named:
                pass
        return True

    def digests(self, named: Iterator[Named]) -> dict[str, str]:
        """A sync source's converted weights' SHA256s; none from the other ranks, which join the gathers."""
        from orchestrator.adapters.digest import sha256_digests

        return {} if self.join_only(named) else sha256_digests(dict(named))

    def push(self, named: Iterator[Named], engine: BucketSink, version: int, bucket_bytes: int) -> TransferReport:
        """A sync source sends `named` to `engine` in buckets; any other rank joins the gathers, sending nothing."""
        from orchestrator.adapters.transport.bucketed import push_in_buckets

        if self.join_only(named):
            return TransferReport(tensors=0, bytes=0, buckets=0)
        return push_in_buckets(named, engine, version, bucket_bytes=bucket_bytes)
