"""The telemetry names in `orchestrator.telemetry.semconv`: one documented constant a name."""

from __future__ import annotations

import ast
import inspect
import itertools

from orchestrator.telemetry import semconv
from states import Event

NAMES = {name: value for name, value in vars(semconv).items() if name.isupper() and isinstance(value, str)}
SPANS = {name: value for name, value in NAMES.items() if name.endswith("_SPAN")}
NOT_KEYS = ("_SPAN", "_PREFIX", "_SCOPE", "_EVENT")
KEYS = {
    name: value
    for name, value in NAMES.items()
    if not name.endswith(NOT_KEYS) and not name.startswith("ROLE_") and name not in ("PREFIX", "TRACER")
}


def test_every_constant_has_a_docstring() -> None:
    tree = ast.parse(inspect.getsource(semconv))
    body = tree.body
    documented = {
        node.target.id
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
    }  # fmt: skip
    assert set(NAMES) - documented == set()
    assert "BYTES_BY_KIND" in documented


def test_attribute_keys_are_namespaced_and_distinct() -> None:
    assert KEYS, "no attribute keys found"
    assert all(value.startswith(semconv.PREFIX) for value in KEYS.values())
    assert len(set(KEYS.values())) == len(KEYS), "two constants hold one key"


def test_span_names_are_distinct_and_rank_work_is_under_the_rank_prefix() -> None:
    assert len(set(SPANS.values())) == len(SPANS)
    rank_work = [semconv.BUCKET_SPAN, semconv.CAST_SPAN, semconv.GATHER_SPAN, semconv.EXTRAS_SPAN, semconv.DIGEST_SPAN]
    assert all(name.startswith(semconv.RANK_PREFIX) for name in rank_work)
    assert semconv.RANK_PREFIX == semconv.ROLE_RANK + "." and semconv.ENGINE_PREFIX == semconv.ROLE_ENGINE + "."


def test_byte_kinds_name_their_keys() -> None:
    assert set(semconv.BYTES_BY_KIND.values()) <= set(KEYS.values())
    assert all(key == f"colocate.bytes_{kind}" for kind, key in semconv.BYTES_BY_KIND.items())


def test_the_wire_names_are_the_ones_users_query() -> None:
    # Literal on purpose: dashboards and saved Jaeger queries hold these strings.
    assert semconv.lifecycle_span(Event.PAUSE_GRADS) == "lifecycle.pause_grads"
    assert (semconv.STEP_SPAN, semconv.STEP, semconv.RANK) == ("colocate.step", "colocate.step", "colocate.rank")
    assert (semconv.REFUSED, semconv.GUARD_REJECTED_EVENT) == ("colocate.refused", "guard.rejected")
    assert semconv.LIFECYCLE_SCOPE == "colocate.lifecycle"
