"""docs/tracing.md names every span, span event and attribute that
`orchestrator/telemetry/semconv.py` defines, so a constant added there is documented there too."""

from __future__ import annotations

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
