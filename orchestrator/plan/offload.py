"""The offload choice's price, both ways, per region of one rank: what moving it costs in
seconds per step against the KV cache tokens keeping it gives up.

A region moves out at pause_grads (or drop_params) and back at restore. What crosses the link
is what a pause copies: `default` keeps a host copy, so its bytes go out and come back;
`grad_buffer` and a rematerialized `param_buffer` are paused without one (grads are zeroed
before use, params are cast and gathered back on the device), so they copy nothing; backup
mode copies the param buffer both ways. The rate is a pinned copy's, each way.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.offload import MOVABLE
from orchestrator.plan.memory import Plan, RankBytes
from states import Mode, Region

# A pinned host <-> device copy, each way, on one H200: 55.1-55.2 GB/s measured (docs/benchmarks.md,
# "The step on one GPU"); the price takes 50, below it.
PINNED_COPY_GBPS = 50.0


@dataclass(frozen=True, slots=True)
class RegionPrice:
    region: Region
    bytes: int
    stays: bool  # the plan's choice keeps it resident through the rollout
    choosable: bool  # False: param_buffer, which drop_params always moves
    copied: int  # bytes a move copies each way
    move_s: float  # seconds per step that moving it costs: out and back
    kv_tokens: int  # KV cache tokens per engine GPU that keeping it gives up


def copied_bytes(p: Plan, r: RankBytes, region: Region) -> int:
    if region is Region.DEFAULT:
        return r.optimizer_state
    if region is Region.PARAM_BUFFER and p.mode is Mode.BACKUP:
        return r.param_buffer
    return 0


def prices(p: Plan, r: RankBytes, *, gbps: float = PINNED_COPY_GBPS) -> list[RegionPrice]:
    """Each region of a rank of `r`'s stage, priced both ways at `gbps` GB/s each way."""
    kept, sizes = p.kept(r), p.region_bytes(r)
    out = []
    for region in (Region.PARAM_BUFFER, *MOVABLE):
        copied = copied_bytes(p, r, region)
        out.append(
            RegionPrice(
                region=region,
                bytes=sizes[region],
                stays=region in kept,
                choosable=region in MOVABLE,
                copied=copied,
                move_s=2 * copied / (gbps * 1e9),
                kv_tokens=sizes[region] // p.kv_token_bytes if p.kv_token_bytes else 0,
            )
        )
    return out
