"""An exhaustive model check of the controller: every event sequence to depth 8, breadth first.

Moves: every event (train and rollout with their work, fault with a cause), the engine turning
busy or idle, the next rebuild flipping a bit, and every event again with an exception injected at each adapter call it makes, in
turn. Roots: both modes; the first cycle verified. Every move's outcome is checked against the
invariants of tests/support/invariants.py; a state already seen (by what the controller knows and
what the fakes hold) is not expanded again. From every FAULTED state, once the engine is idle, a
plain recover must succeed and a whole cycle must follow: after recover the run can progress.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import astuple
from typing import Any

import pytest

from orchestrator import ActionFailed, GuardRejected, IllegalTransition
from orchestrator.errors import FaultWithoutCause
from states import Event, Mode, Phase
from tests.support.invariants import violations
from tests.support.world import Injected, World, build, expected_params, same

DEPTH = 8
EVENTS = [e.value for e in Event if e is not Event.FAULT]
# Besides events: the engine turning busy or idle, and the next rebuild flipping a bit.
WORLD = ["fault", "busy", "idle", "corrupt"]
PLAIN: list[tuple[str, int | None]] = [(e, None) for e in EVENTS] + [(w, None) for w in WORLD]

Move = tuple[str, int | None]


def apply(world: World, move: Move) -> str:
    """Make one move; return 'ok', 'refused' or 'faulted'. Any other exception fails the check."""
    name, fail_at = move
    lc, calls = world.lifecycle, world.calls
    calls.count, calls.fail_at = 0, fail_at
    try:
        if name == "busy":
            world.engine.busy = True
        elif name == "idle":
            world.engine.busy = False
        elif name == "corrupt":
            world.trainer.corrupt_next_rebuild = "layer1.weight"
        elif name == "fault":
            lc.fault(Injected("a rank died"))
        else:
            lc.fire(Event(name), world.work(name))
        return "ok"
    except (IllegalTransition, GuardRejected, FaultWithoutCause):
        return "refused"
    except ActionFailed:
        return "faulted"
    finally:
        calls.fail_at = None


def key(world: World) -> tuple[Any, ...]:
    """What decides every later outcome. It reads the controller's private `Known` on purpose:
    a key that missed what the controller remembers would merge states that behave apart."""
    lc, engine, trainer = world.lifecycle, world.engine, world.trainer
    known = astuple(lc._known)
    known = (*known[1:-2], known[-2] is not None, known[-1])  # step and the digests' values do not matter
    expected = expected_params(trainer)
    return (
        lc.phase,
        lc.fault_cause is None,
        known,
        frozenset(world.regions.paused),
        frozenset(engine.resident),
        engine.busy,
        engine.version,
        same(engine.weights, expected),
        same(trainer.params, expected),
        trainer._extra_backup is not None,
        trainer.corrupt_next_rebuild,
    )


def progress(world: World) -> list[str]:
    """Once the world behaves (engine idle, nothing injected, no bit flipped), recover and then a
    whole cycle succeed."""
    world = copy.deepcopy(world)
    world.engine.busy, world.trainer.corrupt_next_rebuild = False, None
    steps = [("recover", None)] if world.lifecycle.phase is Phase.FAULTED else []
    steps += [("pause_grads", None), ("update_weights", None), ("drop_params", None), ("rollout", None)]
    steps += [("restore", None), ("train", None)]
    for move in steps:
        if apply(world, move) != "ok":
            return [f"{move[0]} did not succeed after recover: {world.lifecycle.fault_cause!r}"]
    return violations(world)


def explore(mode: Mode) -> dict[str, int]:
    root = build(mode, verify_cycles=1)
    start = key(root)
    frontier: list[tuple[World, tuple[Move, ...]]] = [(root, ())]
    seen = {start}
    edges: dict[Any, list[Any]] = {}
    moves_made = 0
    for _ in range(DEPTH):
        next_frontier = []
        for world, path in frontier:
            here = key(world)
            children = []
            for plain in PLAIN:
                trial = copy.deepcopy(world)
                outcome = apply(trial, plain)
                calls = trial.calls.count
                variants = [(trial, plain, outcome)]
                for fail_at in range(calls if plain[0] in EVENTS else 0):
                    injected = copy.deepcopy(world)
                    move = (plain[0], fail_at)
                    variants.append((injected, move, apply(injected, move)))
                for after, move, outcome in variants:
                    moves_made += 1
                    trail = (*path, move)
                    broken = violations(after)
                    if outcome == "refused" and key(after) != here:
                        broken.append(f"a refused {move[0]} changed the state")
                    assert not broken, f"after {trail} ({outcome}): {broken}"
                    child = key(after)
                    children.append(child)
                    if child in seen:
                        continue
                    seen.add(child)
                    if after.lifecycle.phase is Phase.FAULTED:
                        stuck = progress(after)
                        assert not stuck, f"after {trail}: {stuck}"
                    next_frontier.append((after, trail))
            edges[here] = children
        frontier = next_frontier
    # Sequences covered: every path of DEPTH moves through the explored graph (a seen state stands
    # for every path that reaches it).
    counts: dict[Any, int] = {start: 1}
    for _ in range(DEPTH):
        nxt: dict[Any, int] = defaultdict(int)
        for state, n in counts.items():
            for child in edges.get(state, ()):
                nxt[child] += n
        counts = nxt
    return {"states": len(seen), "moves": moves_made, "sequences": sum(counts.values())}


@pytest.mark.parametrize("mode", [Mode.REMATERIALIZE, Mode.BACKUP])
def test_every_sequence_to_depth_8_keeps_the_invariants(mode: Mode, capsys: pytest.CaptureFixture[str]) -> None:
    started, cpu = time.perf_counter(), time.process_time()
    counts = explore(mode)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    with capsys.disabled():
        print(
            f"\nmodel check {mode.value}: {counts['sequences']:,} sequences of {DEPTH} moves, "
            f"{counts['states']:,} distinct states, {counts['moves']:,} moves made, {seconds:.1f} s ({cpu:.1f} s CPU)"
        )
    assert counts["states"] > 50, "the check explored the space, not one corner of it"
