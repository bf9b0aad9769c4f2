"""State diagrams rendered from `states.TABLE` by transitions' own diagram support.

docs/lifecycle.md carries the Mermaid rendering between two markers; `check_document` tells
whether it is stale and `update_document` rewrites that block only.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from states import INITIAL, TABLE, Phase

BEGIN = "<!-- BEGIN generated: colocate diagram --update docs/lifecycle.md -->"
END = "<!-- END generated -->"
TITLE = "colocate lifecycle"


class Format(StrEnum):
    MERMAID = "mermaid"
    DOT = "dot"


class _Model:
    """GraphMachine draws per model; the diagram needs one that is never triggered."""


def render(fmt: Format) -> str:
    from transitions.extensions import GraphMachine

    engine: Literal["mermaid", "graphviz"] = "mermaid" if fmt is Format.MERMAID else "graphviz"
    model = _Model()
    GraphMachine(
        model=model,
        states=Phase,
        transitions=[
            {"trigger": row.event.value, "source": row.source, "dest": row.dest, "conditions": list(row.guards)}
            for row in TABLE
        ],
        initial=INITIAL,
        auto_transitions=False,
        graph_engine=engine,
        show_conditions=True,
        title=TITLE,
    )
    graph = model.get_graph()  # type: ignore[attr-defined]
    text = graph.draw(None) if fmt is Format.MERMAID else graph.source
    return text.rstrip() + "\n"


def _block() -> str:
    return f"{BEGIN}\n```mermaid\n{render(Format.MERMAID)}```\n{END}"


def _split(document: str) -> tuple[str, str, str]:
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no generated block: the document needs the markers\n{BEGIN}\n{END}")
    return document[:start], document[start : end + len(END)], document[end + len(END) :]


def check_document(document: str) -> bool:
    """True when the document's generated block matches the table."""
    return _split(document)[1] == _block()


def update_document(document: str) -> str:
    head, _, tail = _split(document)
    return head + _block() + tail
