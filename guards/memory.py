"""The memory-budget guard: a transition that brings memory back must fit in what is free.

Three rows add device memory (docs/lifecycle.md, memory per phase), and a fourth commits to them:

- update_weights: the engine's weights come back while the trainer's params are still resident;
- rollout: the engine's KV cache and CUDA graphs come back;
- restore: the engine releases what it holds, then the trainer's paused regions come back and
  the rebuild writes into them;
- pause_grads, where the offload choice keeps regions resident (`snap.kept`): the update and the
  rollout to come must fit beside them in what is free now, or the sleep is refused before
  anything moves. With nothing kept, each later row checks its own step, as it always did.

A kept region is never paused, so it is resident in every phase (`device_free` counts it) and
never comes back at restore.

The guard reads the plan's bytes for each and the free bytes from the snapshot, so it refuses
before anything is allocated, naming both numbers.
"""

from __future__ import annotations

from guards.verdict import Verdict, guard, names
from states import EngineMemory, MemoryBudget, Phase, Region, Snapshot

_KV = (EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH)


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def sleep_need(budget: MemoryBudget, kept: frozenset[Region]) -> int:
    """Net bytes the coming sleep adds to a device where every region is resident and the engine
    released (TRAIN), with `kept` staying resident: the worse of its two peaks. At update_weights
    the engine's weights are back and the moved regions but the param buffer gone; at rollout the
    KV cache and graphs are back too, and the param buffer is gone."""
    regions = budget.regions
    moved = sum(n for tag, n in regions.items() if tag not in kept and tag is not Region.PARAM_BUFFER)
    update = budget.engine.get(EngineMemory.WEIGHTS, 0) - moved
    rollout = sum(budget.engine.values()) - moved - regions.get(Region.PARAM_BUFFER, 0)
    return max(update, rollout)


def device_need(snap: Snapshot, budget: MemoryBudget) -> tuple[str, int] | None:
    """(what comes back, net bytes it adds) for the event leaving `snap.phase`; None: nothing does."""
    resident = snap.engine_resident
    if snap.phase is Phase.TRAIN:  # pause_grads
        if not snap.kept:
            return None
        return "pause_grads: the update and rollout to come, beside what the offload choice keeps", sleep_need(
            budget, snap.kept
        )
    if snap.phase is Phase.GRADS_PAUSED:  # update_weights
        need = 0 if EngineMemory.WEIGHTS in resident else budget.engine.get(EngineMemory.WEIGHTS, 0)
        return "update_weights (or skip_update) brings back the engine's weights", need
    if snap.phase is Phase.PARAMS_DROPPED:  # rollout
        need = sum(budget.engine.get(tag, 0) for tag in _KV if tag not in resident)
        return "rollout brings back the engine's KV cache and CUDA graphs", need
    if snap.phase is Phase.ROLLOUT:  # restore
        back = sum(budget.regions.get(tag, 0) for tag in snap.paused)
        released = sum(budget.engine.get(tag, 0) for tag in resident)
        return "restore brings back the trainer's regions after the engine releases its memory", back - released
    return None


@guard
def memory_fits(snap: Snapshot) -> str | None:
    """The memory the next transition brings back fits in the device's free memory."""
    budget = snap.memory
    if budget is None:
        return None
    found = device_need(snap, budget)
    if found is None:
        return None
    what, need = found
    free = device_free(snap, budget)
    if need > free:
        return (
            f"{what}: needs {need:,} bytes ({gb(need)}), {free:,} bytes ({gb(free)}) free on {budget.source}"
            f"{_kept_note(snap, budget)}"
        )
    return None


def _kept_note(snap: Snapshot, budget: MemoryBudget) -> str:
    if not snap.kept:
        return ""
    held = sum(budget.regions.get(tag, 0) for tag in snap.kept)
    return f"; the offload choice keeps {names(snap.kept)} resident ({held:,} bytes, {gb(held)})"


def device_free(snap: Snapshot, budget: MemoryBudget) -> int:
    """The free bytes measured, or the limit less the plan's bytes resident in this snapshot."""
    if budget.device_free is not None:
        return budget.device_free
    limit = budget.device_limit or 0
    regions = sum(n for tag, n in budget.regions.items() if tag not in snap.paused)
    engine = sum(budget.engine.get(tag, 0) for tag in snap.engine_resident)
    return limit - regions - engine


def host_backup_fits(pinned: int, available: int, *, where: str = "the host") -> Verdict:
    """At init: what a rank pins on the host (the mode's backup, the optimizer state's arena where it
    moves) fits in the host's available memory."""
    ok = pinned <= available
    reason = (
        "ok"
        if ok
        else f"the pinned host memory needs {pinned:,} bytes ({gb(pinned)}), "
        f"{available:,} bytes ({gb(available)}) available on {where}"
    )
    return Verdict("host_backup_fits", ok, reason)
