"""An exhaustive model check of the controller: every event sequence to depth 10, breadth first.

Moves: every event (train and rollout with their work, fault with a cause), the engine turning
busy or idle, the next rebuild flipping a bit (where a verified cycle's digests wait to check it:
the fault verification exists to catch), and every event again with a fault injected at each
adapter call it makes, in turn, each way `tests/support/world.py` injects one: before the call
takes effect, after it, partway through it, and a `fault()` from elsewhere while it runs; every
event again with a fault just after its transition, and another during that fault's landing; and
a fault from elsewhere with another during its landing (the `late` and `landing` of world.py). Roots:
both modes; the first cycle verified. Every move's outcome is checked against the invariants of
tests/support/invariants.py; a state already seen (by what the controller knows and what the
fakes hold) is not expanded again. From every FAULTED state, once the world behaves (engine idle,
nothing injected, no bit flipped), a plain recover must succeed and a whole cycle must follow.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator import ActionFailed, GuardRejected, IllegalTransition
from orchestrator.errors import FaultWithoutCause
from states import Event, Mode, Phase
from tests.support.invariants import violations
from tests.support.world import Injected, Saved, World, build, expected_params, injections, same

DEPTH = 10
EVENTS = [e.value for e in Event if e is not Event.FAULT]
# Besides events: the engine turning busy or idle, and the next (verified) rebuild flipping a bit.
WORLD = ["fault", "busy", "idle", "corrupt"]

Move = tuple[str, int | None, str]  # (event or world move, the call to inject at, how)
PLAIN: list[Move] = [(name, None, "") for name in EVENTS + WORLD] + [("fault", None, "landing")]


def apply(world: World, move: Move) -> str:
    """Make one move; return 'ok', 'refused' or 'faulted'. Any other exception fails the check."""
    name, fail_at, how = move
    lc, calls = world.lifecycle, world.calls
    calls.count, calls.fail_at, calls.how, calls.names = 0, fail_at, how, []
    calls.late, calls.landing, calls.landed = how == "late", how in ("late", "landing"), False
    try:
        if name == "busy":
            world.engine.busy = True
        elif name == "idle":
            world.engine.busy = False
        elif name == "corrupt":
            if lc._known.digests is not None:  # a rebuild that a verified cycle checks
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
        calls.fail_at, calls.late, calls.landing = None, False, False


def key(world: World) -> tuple[Any, ...]:
    """What decides every later outcome. It reads the controller's private `Known` on purpose:
    a key that missed what the controller remembers would merge states that behave apart."""
    lc, engine, trainer = world.lifecycle, world.engine, world.trainer
    known, generation = lc._known, trainer.mains_generation()
    expected = expected_params(trainer)

    def behind(seen: int | None) -> int | None:  # generations are counters: only the gap matters
        return None if seen is None else generation - seen

    return (
        lc.phase,
        lc.fault_cause is None,
        tuple(getattr(known, name) for name in known.__slots__[1:6]),  # not the step (astuple deep-copies all)
        behind(known.params_generation),
        min(known.cycles, 1),  # past the one verified cycle, the count changes nothing
        known.digests is not None,
        known.last_restore_verified,
        world.regions.paused,
        frozenset(engine.resident),
        engine.busy,
        engine.version,
        same(engine.weights, expected),
        same(trainer.params, expected),
        bool((trainer.extra == trainer.truth).all()),
        behind(trainer._stashed_at),
        trainer.corrupt_next_rebuild,
    )


def progress(world: World) -> list[str]:
    """Once the world behaves (engine idle, nothing injected, no bit flipped), recover and then a
    whole cycle succeed, and the params after recover are cast(mains) bit for bit."""
    world.engine.busy, world.trainer.corrupt_next_rebuild = False, None
    steps = ["recover"] if world.lifecycle.phase is Phase.FAULTED else []
    steps += ["pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"]
    for step in steps:
        if apply(world, (step, None, "")) != "ok":
            return [f"{step} did not succeed once the world behaved: {world.lifecycle.fault_cause!r}"]
        if step == "recover" and (found := violations(world)):
            return [f"after recover: {found}"]
    return violations(world)


def variants(world: World, state: Saved, plain: Move) -> Iterator[tuple[Move, str]]:
    """The move as it is, then with each injection at each call it made, each from `state`; the
    world holds the move's outcome while the caller looks at it."""
    world.load(state)
    yield plain, apply(world, plain)
    if plain[0] not in EVENTS:
        return
    for index, name in enumerate(list(world.calls.names)):
        for how in injections(name):
            world.load(state)
            move = (plain[0], index, how)
            yield move, apply(world, move)
    world.load(state)
    late: Move = (plain[0], None, "late")
    yield late, apply(world, late)


def explore(mode: Mode) -> dict[str, Any]:
    world = build(mode, verify_cycles=1)
    start = key(world)
    frontier: list[tuple[Saved, tuple[Move, ...], Any]] = [(world.save(), (), start)]
    seen = {start}
    edges: dict[Any, list[Any]] = {}
    injected: Counter[str] = Counter()
    recovered = 0
    for _ in range(DEPTH):
        next_frontier = []
        for state, path, here in frontier:
            world.load(state)
            assert key(world) == here, f"after {path}: the saved world did not load back whole"
            children = []
            for plain in PLAIN:
                for move, outcome in variants(world, state, plain):
                    after = world
                    injected[move[2] or "none"] += 1
                    trail = (*path, move)
                    broken = violations(after)
                    if outcome == "refused" and move[2] == "fault":
                        if after.lifecycle.phase is not Phase.FAULTED:  # refused, and then the fault landed
                            broken.append(f"a fault during a refused {move[0]} did not land")
                    elif outcome == "refused" and key(after) != here:
                        broken.append(f"a refused {move[0]} changed the state")
                    if after.calls.landed:  # a fault during a landing: the cause kept notes it
                        cause = after.lifecycle.fault_cause
                        if after.lifecycle.phase is not Phase.FAULTED or cause is None:
                            broken.append("a landing with a fault during it did not end FAULTED")
                        elif not any("landed" in note for note in getattr(cause, "__notes__", [])):
                            broken.append(f"the fault during a landing was lost: {cause!r}")
                    assert not broken, f"after {trail} ({outcome}): {broken}"
                    child = key(after)
                    children.append(child)
                    if child in seen:
                        continue
                    seen.add(child)
                    saved = world.save()
                    if after.lifecycle.phase is Phase.FAULTED:
                        stuck = progress(world)
                        assert not stuck, f"after {trail}: {stuck}"
                        recovered += 1
                    next_frontier.append((saved, trail, child))
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
    return {"states": len(seen), "sequences": sum(counts.values()), "injected": injected, "recovered": recovered}


@pytest.mark.parametrize("mode", [Mode.REMATERIALIZE, Mode.BACKUP])
def test_every_sequence_to_depth_10_keeps_the_invariants(mode: Mode, capsys: pytest.CaptureFixture[str]) -> None:
    started, cpu = time.perf_counter(), time.process_time()
    counts = explore(mode)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    moves = counts["injected"]
    with capsys.disabled():
        print(
            f"\nmodel check {mode.value}: {counts['sequences']:,} sequences of {DEPTH} moves, "
            f"{counts['states']:,} distinct states, {sum(moves.values()):,} moves made "
            f"({', '.join(f'{n:,} {how}' for how, n in sorted(moves.items()))}), "
            f"{counts['recovered']:,} FAULTED states recovered, {seconds:.1f} s ({cpu:.1f} s CPU)"
        )
    assert counts["states"] > 50, "the check explored the space, not one corner of it"
    assert all(moves[how] for how in ("before", "after", "partial", "fault", "late", "landing")), moves
