"""A checkpoint's manifest is validated as data (issue 42, item 4): `check_manifest` either
returns a manifest of the documented shape (orchestrator/adapters/checkpoints/store.py) or raises
CheckpointRefused naming the problem; no other exception, whatever JSON it is given.

The inputs are seeded random JSON values, and random mutations of a manifest `seal` wrote (a key
dropped, renamed or added, a value replaced by another JSON value): hypothesis is not a dependency,
so the generator is here, and every case is reproducible from its seed and index.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from orchestrator.adapters.checkpoints import CheckpointRefused, begin, check_manifest, seal, verify

CASES = 400
SEED = 42


def _sealed(root: Path) -> Path:
    partial = begin(root, 3)
    (partial / "trainer" / "__0_0.distcp").write_bytes(b"weights")
    (partial / "trainer" / ".metadata").write_bytes(b"meta")
    (partial / "colocate.json").write_text("{}")
    return Path(seal(partial, root, 3).path)


def scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            1,
            -1,
            7,
            2**70,
            0.5,
            -0.0,
            1e308,
            "",
            "a",
            "x" * 64,
            "0" * 64,
            "F" * 64,
            "../up",
            "/abs",
            "trainer/../..",
            "MANIFEST.json",
            "colocate.json",
            "a\\b",
        ]
    )


def value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, nested at most 4 deep."""
    kind = rng.random() if depth < 4 else 0.0
    if kind < 0.5:
        return scalar(rng)
    if kind < 0.75:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["format", "step", "files", "bytes", "sha256", "colocate.json", "x"]
    return {rng.choice(keys): value(rng, depth + 1) for _ in range(rng.randrange(4))}


def paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in `node` a mutation can reach (the root too)."""
    found = [at]
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        found += paths(child, (*at, key))
    return found


def mutate(rng: random.Random, manifest: dict[str, Any]) -> Any:
    """`manifest` with 1 to 3 random changes: a value replaced, a key dropped, renamed or added."""
    root: Any = copy.deepcopy(manifest)
    for _ in range(rng.randint(1, 3)):
        at = rng.choice(paths(root))
        if not at:
            root = value(rng) if rng.random() < 0.2 else root
            continue
        parent = root
        for key in at[:-1]:
            parent = parent[key]
        key, how = at[-1], rng.choice(["replace", "drop", "rename", "add"])
        if how == "replace":
            parent[key] = value(rng)
        elif how == "drop":
            del parent[key]
        elif isinstance(parent, dict) and how == "rename":
            parent[str(scalar(rng))] = parent.pop(key)
        elif isinstance(parent, dict):
            parent[str(scalar(rng))] = value(rng)
        else:
            parent.append(value(rng))
    return root


def well_formed(listed: Any) -> bool:
    """The documented shape, written out again independently of the validator."""
    hexdigits = set("0123456789abcdef")

    def count(n: Any) -> bool:
        return type(n) is int and n >= 0

    def entry(e: Any) -> bool:
        return (
            isinstance(e, dict)
            and set(e) == {"bytes", "sha256"}
            and count(e["bytes"])
            and isinstance(e["sha256"], str)
            and len(e["sha256"]) == 64
            and set(e["sha256"]) <= hexdigits
        )

    def name(n: str) -> bool:
        parts = n.split("/")
        return (
            bool(n)
            and not n.startswith("/")
            and "\\" not in n
            and "\x00" not in n
            and n != "MANIFEST.json"
            and all(p not in ("", ".", "..") for p in parts)
        )

    return (
        isinstance(listed, dict)
        and set(listed) == {"format", "step", "files"}
        and type(listed["format"]) is int
        and listed["format"] == 1
        and count(listed["step"])
        and isinstance(listed["files"], dict)
        and all(name(n) and entry(e) for n, e in listed["files"].items())
    )


def judged(listed: Any) -> str:
    """'accepted' or 'refused'; any other exception propagates and fails the test."""
    try:
        returned = check_manifest(listed)
    except CheckpointRefused as exc:
        assert exc.violations and all(str(v) for v in exc.violations)
        return "refused"
    assert returned is listed and well_formed(listed), listed
    return "accepted"


def test_the_manifest_seal_writes_is_accepted(tmp_path: Path) -> None:
    checkpoint = _sealed(tmp_path)
    listed = json.loads((checkpoint / "MANIFEST.json").read_text())
    assert judged(listed) == "accepted" and verify(checkpoint) == listed


def test_random_json_is_accepted_only_in_the_documented_shape() -> None:
    rng = random.Random(SEED)
    outcomes = {judged(value(rng)) for _ in range(CASES)}
    assert outcomes == {"refused"}  # a random value of the exact shape is too unlikely to expect


def test_mutations_of_a_real_manifest_are_accepted_or_refused_never_a_traceback(tmp_path: Path) -> None:
    listed = json.loads((_sealed(tmp_path) / "MANIFEST.json").read_text())
    rng = random.Random(SEED)
    outcomes = []
    for index in range(CASES):
        mutated = mutate(rng, listed)
        outcome = judged(mutated)
        assert outcome == ("accepted" if well_formed(mutated) else "refused"), (index, mutated)
        outcomes.append(outcome)
    assert outcomes.count("refused") > CASES // 2 and "accepted" in outcomes, outcomes.count("refused")


@pytest.mark.parametrize(
    ("listed", "words"),
    [
        ([], "a list, not an object of format, step and files"),
        ({"format": 2, "step": 1, "files": {}}, "format 2; this colocate reads format 1"),
        ({"format": 1, "step": True, "files": {}}, "step is true, not a whole number >= 0"),
        ({"format": 1, "step": 1}, "no 'files'"),
        ({"format": 1, "step": 1, "files": {"../x": {"bytes": 0, "sha256": "0" * 64}}}, "not a plain relative path"),
        ({"format": 1, "step": 1, "files": {"a": {"bytes": -1, "sha256": "0" * 64}}}, "bytes is -1"),
        ({"format": 1, "step": 1, "files": {"a": {"bytes": 0, "sha256": "F" * 64}}}, "not 64 lowercase hex digits"),
    ],
)
def test_each_problem_is_named(listed: Any, words: str) -> None:
    with pytest.raises(CheckpointRefused) as refused:
        check_manifest(listed, "M.json")
    assert words in str(refused.value), str(refused.value)
