"""`colocate trace timeline`: one step of a trace as a picture, phases × ranks on a time axis."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from orchestrator.errors import TraceError
from orchestrator.traces import ENGINE_PREFIX, FORMATS, PHASE_PREFIX, RANK_PREFIX, Span, Step
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
        handles = [Patch(color=color, label=name) for name, color in colors.items()]
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
                label = span.name.removeprefix(PHASE_PREFIX)
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


def _colors(step: Step) -> dict[str, Any]:
    """Each lifecycle event keeps its tab10 color in every picture; work spans take pastels, 29 apart."""
    from matplotlib import colormaps

    order = [e.value for e in Event]
    pastels = [c for name in ("Set3", "Pastel1", "Pastel2") for c in colormaps[name].colors]  # type: ignore[attr-defined]
    colors: dict[str, Any] = {}
    for name in sorted({s.name for s in step.spans}, key=lambda n: (not n.startswith(PHASE_PREFIX), n)):
        event = name.removeprefix(PHASE_PREFIX)
        if name.startswith(PHASE_PREFIX) and event in order:
            colors[name] = colormaps["tab10"](order.index(event) % 10)
        else:
            colors[name] = pastels[sum(not n.startswith(PHASE_PREFIX) for n in colors) % len(pastels)]
    return colors


def _depth(step: Step, span: Span, row: list[Span]) -> int:
    """How many of the span's ancestors sit in the same row."""
    ids, depth = {s.span_id for s in row}, 0
    parent = step.parent(span)
    while parent is not None:
        depth += parent.span_id in ids
        parent = step.parent(parent)
    return depth
