"""`colocate trace timeline`: one step of a trace as a picture, phases × ranks on a time axis."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from orchestrator.cli.traces.model import FORMATS, Span, Step
from orchestrator.errors import TraceError
from orchestrator.telemetry.semconv import CAUSE, ENGINE_PREFIX, LIFECYCLE_PREFIX, RANK_PREFIX, lifecycle_span
from states import Event


def draw_timeline(step: Step, output: Path) -> None:
    """One step as a picture, in the format of the suffix (.png or .svg); see `timeline_figure`."""
    fmt = output.suffix.lower().removeprefix(".")
    if fmt not in FORMATS:
        raise TraceError(f"{output}: unknown picture format {output.suffix or '(no suffix)'!r}; use .png or .svg")
    figure = timeline_figure(step)
    try:
        figure.savefig(output, format=fmt)
    except OSError as exc:
        raise TraceError(f"cannot write {output}: {exc.strerror or exc}") from None


def timeline_figure(step: Step) -> Any:
    """Above, horizontal bars on a time axis (ms): the driver's phases and its own work, each
    trainer rank's work, the engine's. Below, the phases in the order they ran at equal widths,
    each with its duration, so that a 3 ms phase of a 9 s step still reads. A faulted step says so
    in its title, with the cause, and its fault is a red line through every row.

    Draws on Agg without pyplot, so no GUI backend and no global figure state.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise TraceError("the timeline needs matplotlib: pip install matplotlib") from None
    rows, colors = _rows(step), _colors(step)
    figure = Figure(figsize=(12, 2.4 + 0.55 * len(rows)), layout="constrained")
    FigureCanvasAgg(figure)
    axes, strip = figure.subplots(2, 1, height_ratios=[len(rows), 1.2])
    offsets = [step.offset_ms(t) for s in step.spans for t in (s.start_ns, s.end_ns)]
    low, high = min([0.0, *offsets]), max([step.root.duration_ms, *offsets])  # other clocks may stray a little
    axes.set_xlim(low, high)
    _draw_bars(axes, step, rows, colors, min_width=MIN_WIDTH * (high - low))
    axes.set_yticks(range(len(rows)), [name for name, _ in rows])
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_xlabel("ms from step start")
    axes.set_title(_title(step), loc="left", color="black" if step.complete else "firebrick")
    axes.grid(axis="x", alpha=0.3)
    _draw_strip(strip, step, colors)
    families = _families(step)
    if families:
        handles = [Patch(color=_FAMILY_COLORS[f], label=f) for f in families]
        figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    return figure


MIN_WIDTH = 0.004  # of the time axis: the narrowest a phase or a failed span is drawn, so none vanishes
FAULT = lifecycle_span(Event.FAULT)


def _title(step: Step) -> str:
    trace_id = f"trace {step.root.trace_id}"
    if step.complete:
        return f"step {step.number}: {step.root.duration_ms:.1f} ms   ({trace_id})"
    fault = next((s for s in step.phases if s.name == FAULT), None)
    cause = str(fault.attributes.get(CAUSE, "")).split("\n", 1)[0] if fault is not None else ""
    cause = cause if len(cause) <= 110 else cause[:109] + "…"
    return f"step {step.number} FAULTED after {step.root.duration_ms:.1f} ms   ({trace_id})" + (
        f"\n{cause}" if cause else ""
    )


def _draw_bars(
    axes: Any, step: Step, rows: list[tuple[str, list[Span]]], colors: dict[str, Any], min_width: float
) -> None:
    for phase in step.phases:  # faint bands carry each phase down through the rank and engine rows
        axes.axvspan(step.offset_ms(phase.start_ns), step.offset_ms(phase.end_ns), color=colors[phase.name], alpha=0.08)
    total = step.root.duration_ms or 1.0
    for y, (_, spans) in enumerate(rows):
        for span in spans:
            height = max(0.25, 0.7 - 0.15 * _depth(step, span, spans))  # nested work thinner, over its parent
            x, width = step.offset_ms(span.start_ns), span.duration_ms
            if span.name.startswith(LIFECYCLE_PREFIX) or span.status == "ERROR":
                width = max(width, min_width)
            failed = span.status == "ERROR" and not span.refused and span.name != FAULT  # work too, not just phases
            axes.broken_barh(
                [(x, width)], (y - height / 2, height), facecolors=colors[span.name],
                edgecolors="firebrick" if span.status == "ERROR" else "none", hatch="////" if failed else None,
            )  # fmt: skip
            if span.refused:  # zero width: a mark, so the refusal shows
                axes.plot(x, y, marker="X", color="black", markeredgecolor="white", markersize=10)
            elif y == 0 and width > 0.06 * total and span.name.startswith(LIFECYCLE_PREFIX):
                label = span.name.removeprefix(LIFECYCLE_PREFIX)
                axes.text(x + width / 2, y, label, ha="center", va="center", fontsize=8, clip_on=True)
    for fault in (s for s in step.phases if s.name == FAULT):
        x = step.offset_ms(fault.start_ns)
        axes.axvline(x, color="firebrick", linewidth=1.5, linestyle="--")
        right = x > (axes.get_xlim()[0] + axes.get_xlim()[1]) / 2  # the label on the side with room
        axes.text(
            x, -0.5, "fault " if right else " fault", color="firebrick", ha="right" if right else "left", va="top",
            fontsize=9, fontweight="bold",
        )  # fmt: skip


def _draw_strip(axes: Any, step: Step, colors: dict[str, Any]) -> None:
    """The step's phases in the order they ran, at equal widths, each labelled with its duration."""
    phases = step.phases
    size = 8 if len(phases) <= 8 else 7 if len(phases) <= 11 else 6
    for i, phase in enumerate(phases):
        event = phase.name.removeprefix(LIFECYCLE_PREFIX)
        what = "refused" if phase.refused else f"{_ms(phase.duration_ms)}" + (" failed" if phase.failed else "")
        error = phase.status == "ERROR"
        axes.add_patch(_cell(i, colors[phase.name], error, phase.refused or phase.failed))
        weight = "bold" if error else "normal"
        axes.text(i + 0.5, 0.5, f"{event}\n{what}", ha="center", va="center", fontsize=size, fontweight=weight)
    axes.set_xlim(0, max(1, len(phases)))
    axes.set_ylim(0, 1)
    axes.set_axis_off()
    axes.set_title("phases in the order they ran, equal widths", fontsize=8, loc="left")


def _cell(i: int, color: Any, error: bool, hatched: bool) -> Any:
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Rectangle

    return Rectangle(
        (i + 0.02, 0.05), 0.96, 0.9, facecolor=to_rgba(color, 0.45), edgecolor="firebrick" if error else "white",
        linewidth=2 if error else 1, hatch="////" if hatched else None,
    )  # fmt: skip


def _ms(ms: float) -> str:
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


def _rows(step: Step) -> list[tuple[str, list[Span]]]:
    """The driver's phases with its own work (a check, an HTTP call), each rank's, the engine's."""
    ranks: dict[int, list[Span]] = defaultdict(list)
    driver = list(step.phases)
    for span in step.spans:
        if span.name.startswith(RANK_PREFIX) and span.rank is not None:
            ranks[span.rank].append(span)
        elif not span.name.startswith((RANK_PREFIX, ENGINE_PREFIX, LIFECYCLE_PREFIX)):
            driver.append(span)
    rows = [("driver", driver)]
    rows += [(f"rank {rank}", ranks[rank]) for rank in sorted(ranks)]
    engine = [s for s in step.spans if s.name.startswith(ENGINE_PREFIX)]
    return rows + ([("engine", engine)] if engine else [])


# Work spans by family: what the work does, whichever process does it. Each family keeps one
# colour in every picture, so a colour means the same thing from step to step.
FAMILIES: dict[str, tuple[str, ...]] = {
    "memory": ("stash", "pause", "resume", "release", "flush_cache", "release_memory_occupation",
               "resume_memory_occupation"),
    "weight sync": ("push_weights", "broadcast_weights", "bucket", "update_weights", "update_weights_from_tensor",
                    "update_weights_from_distributed", "begin_weight_update", "end_weight_update",
                    "update_weight_version", "init_weights_update_group", "destroy_weights_update_group"),
    "rebuild": ("rebuild", "cast", "gather", "extras"),
    "digests": ("digest", "digests", "converted_digests", "engine_matches_trainer"),
    "rollout": ("generate", "pause_generation", "continue_generation", "abort_request"),
    "train": ("train",),
}  # fmt: skip
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
    """The family of a work span (`rank.cast` → rebuild, `POST /generate` → rollout), `other` if
    it has none."""
    method = name.rsplit("/", 1)[-1] if " /" in name else name.split(".", 1)[-1]
    return _FAMILY_OF.get(method, OTHER)


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


def _families(step: Step) -> list[str]:
    """The work families drawn in this step, in `FAMILIES` order (the phases name themselves below)."""
    present = {family(s.name) for s in step.spans if not s.name.startswith(LIFECYCLE_PREFIX)}
    return [f for f in [*FAMILIES, OTHER] if f in present]


def _depth(step: Step, span: Span, row: list[Span]) -> int:
    """How many of the span's ancestors sit in the same row."""
    ids, depth = {s.span_id for s in row}, 0
    parent = step.parent(span)
    while parent is not None:
        depth += parent.span_id in ids
        parent = step.parent(parent)
    return depth
