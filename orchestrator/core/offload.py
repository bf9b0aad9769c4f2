"""The offload choice: which trainer regions leave the device for the rollout, decided once.

`param_buffer` always leaves (drop_params is that move; under rematerialize it copies nothing,
the restore casts and gathers the params back). The choice is over what pause_grads pauses:

- `default`: the fp32 mains and Adam moments, paused with a host copy: a copy out at
  pause_grads and back at restore, the price of moving it;
- `grad_buffer`: paused without a backup (grads are zeroed before use): no copy, only the
  memory unmapped and mapped again.

`auto` keeps a region where the coming update and rollout fit beside it (the plan's bytes, the
engine's weights, KV cache and CUDA graphs, against what is free), trying `default` first (it
costs copies to move), then `grad_buffer`. `never` keeps both and refuses, naming the numbers,
where they do not fit. Without a memory plan `auto` has nothing to decide from and moves both,
as `always` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from guards.memory import gb, sleep_need
from guards.verdict import names
from orchestrator.errors import ConfigError
from states import MemoryBudget, Offload, Region

# The regions the choice is over, in the order `auto` tries to keep them.
MOVABLE: tuple[Region, ...] = (Region.DEFAULT, Region.GRAD_BUFFER)


@dataclass(frozen=True, kw_only=True, slots=True)
class Residency:
    """The choice a lifecycle holds for its run: `keep` stays resident through every sleep."""

    offload: Offload = Offload.ALWAYS
    keep: frozenset[Region] = frozenset()
    spare: int | None = None  # bytes the tightest point of a sleep leaves free; None: no plan

    @property
    def moves(self) -> frozenset[Region]:
        return frozenset(Region) - self.keep


def free_at_train(budget: MemoryBudget) -> int:
    """Free bytes with every region resident and the engine released, as at start-up."""
    if budget.device_free is not None:
        return budget.device_free
    return (budget.device_limit or 0) - sum(budget.regions.values())


def choose(offload: Offload, budget: MemoryBudget | None) -> Residency:
    """The regions `offload` keeps, given the plan's bytes and what is free at start-up.

    Raises ConfigError under `never` where the update or the rollout does not fit beside both
    regions, naming what they need and what is free."""
    if budget is None:
        keep = frozenset(MOVABLE) if offload is Offload.NEVER else frozenset()
        return Residency(offload=offload, keep=keep)
    free = free_at_train(budget)
    if offload is Offload.ALWAYS:
        return Residency(offload=offload, spare=free - sleep_need(budget, frozenset()))
    if offload is Offload.NEVER:
        keep = frozenset(MOVABLE)
        need = sleep_need(budget, keep)
        if need > free:
            held = sum(budget.regions.get(tag, 0) for tag in keep)
            raise ConfigError(
                [
                    f"offload never keeps {names(keep)} resident ({held:,} bytes, {gb(held)}): the update and "
                    f"rollout then need {need:,} bytes ({gb(need)}) beyond them, and {free:,} bytes ({gb(free)}) "
                    f"are free on {budget.source}. Offload auto or always moves them."
                ]
            )
        return Residency(offload=offload, keep=keep, spare=free - need)
    kept: frozenset[Region] = frozenset()
    for region in MOVABLE:
        if sleep_need(budget, kept | {region}) <= free:
            kept |= {region}
    return Residency(offload=offload, keep=kept, spare=free - sleep_need(budget, kept))
