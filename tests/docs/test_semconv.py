"""docs/tracing.md names every span, span event and attribute that
`orchestrator/telemetry/semconv.py` defines, so a constant added there is documented there too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from orchestrator.telemetry import semconv
from states import Event

TRACING = (Path(__file__).resolve().parents[2] / "docs" / "tracing.md").read_text()
NAMES = {name: value for name, value in vars(semconv).items() if name.isupper() and isinstance(value, str)}


def quoted(text: str) -> set[str]:
    """Every `code` span of the text, and every word of its untagged blocks (the span trees)."""
    inline = set(re.findall(r"`([^`\n]+)`", text))
    trees = re.findall(r"^```\n(.*?)^```", text, flags=re.M | re.S)
    return inline | {word for tree in trees for word in re.findall(r"[\w.]+", tree)}


def test_every_attribute_key_is_documented_without_its_prefix() -> None:
    shown = quoted(TRACING)
    keys = [v for n, v in NAMES.items() if v.startswith(semconv.PREFIX) and not n.endswith(("_SPAN", "_SCOPE"))]
    missing = [key for key in keys if key.removeprefix(semconv.PREFIX) not in shown and key not in shown]
    assert missing == [], f"docs/tracing.md does not name {missing}"


def test_every_span_name_event_and_role_is_documented() -> None:
    shown = quoted(TRACING)
    names = [v for n, v in NAMES.items() if n.endswith(("_SPAN", "_EVENT")) or n.startswith("ROLE_")]
    missing = [name for name in names if name not in shown]
    assert missing == [], f"docs/tracing.md does not name {missing}"
    assert semconv.PREFIX in shown and semconv.lifecycle_span(Event.TRAIN) in shown


def test_the_tracing_page_points_at_the_constants() -> None:
    assert "orchestrator/telemetry/semconv.py" in TRACING


ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("TrainerRank", "EngineReplica")


def _worker_spans() -> set[str]:
    """`<role>.<method>`: every span a worker opens for a call the driver makes on it (`Traced.invoke`),
    read off the code's calls that name a worker's method (`ranks.all(TrainerRank.stash)`)."""
    from orchestrator.job.workers.engine_replica import EngineReplica
    from orchestrator.job.workers.trainer_rank import TrainerRank

    roles = {"TrainerRank": TrainerRank.role, "EngineReplica": EngineReplica.role}
    called = set()
    for path in (ROOT / "orchestrator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for arg in node.args:
                    if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id in WORKERS:
                        called.add((arg.value.id, arg.attr))
    assert len(called) > 20  # the reader still finds the calls
    return {f"{roles[cls]}.{method}" for cls, method in called if method not in TrainerRank.untraced}


def _sglang_posts() -> set[str]:
    """`POST <route>`: the client span of every action the SGLang adapter posts (a GET has none)."""
    routes, gets = set(), set()
    for path in (ROOT / "orchestrator" / "adapters" / "engines" / "sglang").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"/[a-z_]+", node.value):
                routes.add(node.value)
            if isinstance(node, ast.Call) and [getattr(a, "value", None) for a in node.args[:1]] == ["GET"]:
                gets.add(getattr(node.args[1], "value", None))
    assert "/update_weights_from_tensor" in routes and "/model_info" in gets  # the reader still finds them
    return {f"POST {route}" for route in routes - gets}


def test_every_span_the_workers_and_the_sglang_client_open_is_documented() -> None:
    """The spans named at run time, not by a constant: a worker's `<role>.<method>`, SGLang's `POST <route>`."""
    shown = quoted(TRACING)
    missing = sorted(name for name in _worker_spans() | _sglang_posts() if name not in shown)
    assert missing == [], f"docs/tracing.md does not name {missing}"
