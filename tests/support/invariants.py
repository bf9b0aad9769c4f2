"""The invariants of the lifecycle, written once: the hazards tests/support/world.py records, the
memory table of docs/lifecycle.md ("What is resident in each phase"), and what recovery promises. The model check (tests/unit/test_model_check.py) asserts them
after every move of every sequence it explores.

Hazards are caught as the adapter call is made (tests/support/world.py); the state invariants
below are read from the fakes' own state, not from what the controller believes.
"""

from __future__ import annotations

from states import EngineMemory, Phase, Region
from tests.support.world import World, expected_params, same

PARAM, GRAD, DEFAULT = Region.PARAM_BUFFER.value, Region.GRAD_BUFFER.value, Region.DEFAULT.value
KV = {EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH}

# What each phase holds resident (docs/lifecycle.md, memory per phase): paused trainer regions,
# and the engine memory that must / must not be resident.
PAUSED = {
    Phase.TRAIN: set(),
    Phase.GRADS_PAUSED: {GRAD, DEFAULT},
    Phase.WEIGHTS_SYNCED: {GRAD, DEFAULT},
    Phase.PARAMS_DROPPED: {GRAD, DEFAULT, PARAM},
    Phase.ROLLOUT: {GRAD, DEFAULT, PARAM},
}
ENGINE = {
    Phase.TRAIN: set(),
    Phase.GRADS_PAUSED: set(),
    Phase.WEIGHTS_SYNCED: {EngineMemory.WEIGHTS},
    Phase.PARAMS_DROPPED: {EngineMemory.WEIGHTS},
    Phase.ROLLOUT: set(EngineMemory),
}


def violations(world: World) -> list[str]:
    """Every invariant `world` breaks now (versions going back are caught as hazards at the push)."""
    lc, engine, trainer = world.lifecycle, world.engine, world.trainer
    found = list(world.calls.hazards)
    phase = lc.phase
    if phase is Phase.FAULTED:
        if lc.fault_cause is None:
            found.append("FAULTED without a kept cause")
        return found
    if lc.fault_cause is not None:
        found.append(f"{phase} still holds a fault cause")
    if set(world.regions.paused) != PAUSED[phase]:
        found.append(f"{phase}: paused regions {sorted(world.regions.paused)}, expected {sorted(PAUSED[phase])}")
    if KV & engine.resident and PARAM not in world.regions.paused:
        found.append(f"{phase}: engine KV resident with the trainer's params resident (OOM)")
    wanted = ENGINE[phase]
    if phase is Phase.TRAIN or phase is Phase.GRADS_PAUSED:
        if engine.resident & (KV | ({EngineMemory.WEIGHTS} if phase is Phase.TRAIN else set())):
            found.append(f"{phase}: engine holds {sorted(engine.resident)}")
    elif not wanted <= engine.resident or (engine.resident - wanted) & KV:
        found.append(f"{phase}: engine holds {sorted(engine.resident)}, expected {sorted(wanted)}")
    if PARAM not in world.regions.paused and not same(trainer.params, expected_params(trainer)):
        found.append(f"{phase}: resident params are not the ones the fp32 mains define")
    if not bool((trainer.extra == trainer.truth).all()):
        found.append(f"{phase}: the extra is not what the last step left (a stale stash was copied back?)")
    if phase in (Phase.WEIGHTS_SYNCED, Phase.PARAMS_DROPPED, Phase.ROLLOUT):
        if engine.version != lc.weight_version:
            found.append(f"{phase}: engine serves {engine.version}, colocate pushed {lc.weight_version}")
        if not same(engine.weights, expected_params(trainer)):
            found.append(f"{phase}: the engine's weights are not the trainer's")
    return found
