"""`colocate trace timeline`: one step of a trace as a picture, phases × ranks on a time axis."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from orchestrator.cli.traces.model import FORMATS, Span, Step
from orchestrator.errors import TraceError
from orchestrator.telemetry.semconv import ENGINE_PREFIX, LIFECYCLE_PREFIX, RANK_PREFIX
from states import Event


def draw_timeline(step: Step, output: Path) -> None:
    """One step as horizontal bars: the driver's phases, each trainer rank, the engine; x in ms.

    The format comes from the suffix (.png or .svg). Draws on Agg without pyplot, so no GUI
    backend and no global figure state.
    """
    fmt = output.suffix.lower().removeprefix(".")
    if fmt not in FORMATS:
        raise TraceError(f"{output}: unknown picture format {output.suffix or '(no suffix)'!r}; use .png or .svg")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise TraceError("the timeline needs matplotlib: pip install matplotlib") from None
    rows, colors = _rows(step), _colors(step)
    figure = Figure(figsize=(12, 1.6 + 0.55 * len(rows)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    _draw_bars(axes, step, rows, colors)
    axes.set_yticks(range(len(rows)), [name for name, _ in rows])
    axes.set_ylim(len(rows) - 0.5, -0.5)
    offsets = [step.offset_ms(t) for s in step.spans for t in (s.start_ns, s.end_ns)]
    axes.set_xlim(min([0.0, *offsets]), max([step.root.duration_ms, *offsets]))  # other clocks may stray a little
    axes.set_xlabel("ms from step start")
    axes.set_title(f"step {step.number}: {step.root.duration_ms:.1f} ms (trace {step.root.trace_id})")
    axes.grid(axis="x", alpha=0.3)
    if colors:
        handles = [Patch(color=color, label=name) for name, color in _legend(step, colors).items()]
        figure.legend(handles=handles, loc="outside lower center", ncols=min(6, len(handles)), fontsize=8)
    try:
        figure.savefig(output, format=fmt)
    except OSError as exc:
        raise TraceError(f"cannot write {output}: {exc.strerror or exc}") from None


def _draw_bars(axes: Any, step: Step, rows: list[tuple[str, list[Span]]], colors: dict[str, Any]) -> None:
    for phase in step.phases:  # faint bands carry each phase down through the rank and engine rows
        axes.axvspan(step.offset_ms(phase.start_ns), step.offset_ms(phase.end_ns), color=colors[phase.name], alpha=0.08)
    total = step.root.duration_ms or 1.0
    for y, (_, spans) in enumerate(rows):
        for span in spans:
            height = max(0.25, 0.7 - 0.15 * _depth(step, span, spans))  # nested work thinner, over its parent
            x, width = step.offset_ms(span.start_ns), span.duration_ms
            edge = "red" if span.status == "ERROR" else "none"
            axes.broken_barh([(x, width)], (y - height / 2, height), facecolors=colors[span.name], edgecolors=edge)
            if span.refused:  # zero width: a mark, so the refusal shows
                axes.plot(x, y, marker="X", color="black", markeredgecolor="white", markersize=10)
            elif y == 0 and width > 0.06 * total:
                label = span.name.removeprefix(LIFECYCLE_PREFIX)
                axes.text(x + width / 2, y, label, ha="center", va="center", fontsize=8, clip_on=True)


def _rows(step: Step) -> list[tuple[str, list[Span]]]:
    ranks: dict[int, list[Span]] = defaultdict(list)
    for span in step.spans:
        if span.name.startswith(RANK_PREFIX) and span.rank is not None:
            ranks[span.rank].append(span)
    rows = [("driver", step.phases)]
    rows += [(f"rank {rank}", ranks[rank]) for rank in sorted(ranks)]
    engine = [s for s in step.spans if s.name.startswith(ENGINE_PREFIX)]
    return rows + ([("engine", engine)] if engine else [])


# Work spans by family: what the work does, whichever process does it. Each family keeps one
# colour in every picture, so a colour means the same thing from step to step.
FAMILIES: dict[str, tuple[str, ...]] = {
    "memory": ("stash", "pause", "resume", "release", "flush_cache"),
    "weight sync": ("push_weights", "broadcast_weights", "bucket", "update_weights"),
    "rebuild": ("rebuild", "cast", "gather", "extras"),
    "digests": ("digest", "digests", "converted_digests"),
    "rollout": ("generate",),
    "train": ("train",),
}
OTHER = "other"
_FAMILY_COLORS = {  # Pastel1, one per family; lifecycle phases take tab10, by event
    "memory": "#b3cde3",
    "weight sync": "#fbb4ae",
    "rebuild": "#ccebc5",
    "digests": "#decbe4",
    "rollout": "#fed9a6",
    "train": "#e5d8bd",
    OTHER: "#d9d9d9",
}
_FAMILY_OF = {method: family for family, methods in FAMILIES.items() for method in methods}


def family(name: str) -> str:
    """The family of a work span (`rank.cast` → rebuild), `other` if it has none."""
    return _FAMILY_OF.get(name.split(".", 1)[-1], OTHER)


def _colors(step: Step) -> dict[str, Any]:
    """A colour per span name, from the name alone: each lifecycle event its tab10 colour, each
    work span its family's."""
    from matplotlib import colormaps

    order = [e.value for e in Event]
    colors: dict[str, Any] = {}
    for name in sorted({s.name for s in step.spans}, key=lambda n: (not n.startswith(LIFECYCLE_PREFIX), n)):
        event = name.removeprefix(LIFECYCLE_PREFIX)
        if name.startswith(LIFECYCLE_PREFIX) and event in order:
            colors[name] = colormaps["tab10"](order.index(event) % 10)
        else:
            colors[name] = _FAMILY_COLORS[family(name)]
    return colors


def _legend(step: Step, colors: dict[str, Any]) -> dict[str, Any]:
    """Label → colour: the lifecycle events, then the work families, present in this step."""
    phases = {name: color for name, color in colors.items() if name.startswith(LIFECYCLE_PREFIX)}
    present = {family(s.name) for s in step.spans if s.name.startswith((RANK_PREFIX, ENGINE_PREFIX))}
    families = {f: _FAMILY_COLORS[f] for f in [*FAMILIES, OTHER] if f in present}
    return {**phases, **families}


def _depth(step: Step, span: Span, row: list[Span]) -> int:
    """How many of the span's ancestors sit in the same row."""
    ids, depth = {s.span_id for s in row}, 0
    parent = step.parent(span)
    while parent is not None:
        depth += parent.span_id in ids
        parent = step.parent(parent)
    return depth
