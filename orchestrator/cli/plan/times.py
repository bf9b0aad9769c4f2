"""The time model's predictions for people (a Rich table) and machines (`--json`'s `timing`)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.plan.figures import RATE_SOURCES, Link, LinkRates, published
from orchestrator.plan.memory import Plan
from orchestrator.plan.timing import NOT_MODELLED, PHASES, PhaseTime, StageTime, Term

STREAM = "moments, visible"
STREAM_RESTORE = "restore, streamed"


def _slowest(stages: list[StageTime], phase: str) -> PhaseTime:
    return max((s.phases[phase] for s in stages), key=lambda x: x.seconds)


def _bound(x: PhaseTime) -> str:
    return x.bound.says() if x.bound else f"nothing crosses a link ({NOT_MODELLED})"


def _visible(s: StageTime) -> str:
    v = s.moments.visible
    if s.moments.term is None:
        return "0 (nothing to stream)"
    return f"unknown of {s.moments.seconds:.3f}" if v is None else f"{v:.3f}"


def show_timing(p: Plan, stages: list[StageTime], rates: LinkRates, console: Console) -> None:
    """Per phase: each stage's seconds and a published figure beside them; then what bounds each
    phase at its slowest stage, and the rates with their sources."""
    table = Table(title="predicted seconds per phase, the slowest rank of each stage (links' bytes / rates, in series)")
    table.add_column("phase", no_wrap=True)
    for s in stages:
        table.add_column(f"stage {s.stage}", justify="right")
    figures = published(p.model.name)
    if figures:
        table.add_column("published", justify="right")
    for name in PHASES:
        f = figures.get(name)
        table.add_row(
            name,
            *(f"{s.phases[name].seconds:.3f}" for s in stages),
            *([f"{f.seconds:g}" if f else ""] if figures else []),
        )
    table.add_row(STREAM, *(_visible(s) for s in stages), *([""] if figures else []))
    table.add_row(STREAM_RESTORE, *(f"{s.restore_with_stream:.3f}" for s in stages), *([""] if figures else []))
    console.print(table)
    lines = ["bound of each phase (its slowest stage):"]
    lines += [f"  {name}: {_bound(_slowest(stages, name))}" for name in PHASES]
    longest = max(stages, key=lambda s: s.moments.seconds)
    if longest.moments.term:
        lines.append(f"  {STREAM}: {longest.moments.term.says()}, less the forward + backward it runs under")
    lines.append(f"  {STREAM_RESTORE}: restore without the moments' copy (issue 40, item 1)")
    lines += [f"published: {f.phase} {f.seconds:g} s, {f.what} ({f.source})" for f in figures.values()]
    lines.append(f"rates: {rates.source}")
    for link in Link:
        where = "measured here" if link in rates.measured else RATE_SOURCES[link]
        lines.append(f"  {link}: {rates.gbps(link):,.1f} GB/s ({where})")
    if stages[0].moments.train_seconds is None:
        lines.append("  the moments' visible seconds need the train's: give --train-seconds")
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def _term_json(t: Term) -> dict[str, Any]:
    return {"what": t.what, "link": t.link.value, "bytes": t.bytes, "gbps": t.gbps, "seconds": t.seconds}


def timing_json(p: Plan, stages: list[StageTime], rates: LinkRates) -> dict[str, Any]:
    return {
        "rates": {
            "source": rates.source,
            **{link.name.lower(): {"gbps": rates.gbps(link), "measured": link in rates.measured} for link in Link},
        },
        "stages": [
            {
                "stage": s.stage,
                "rank": s.rank,
                "phases": {
                    name: {
                        "seconds": x.seconds,
                        "bound": _term_json(x.bound) if x.bound else None,
                        "terms": [_term_json(t) for t in x.terms],
                    }
                    for name, x in s.phases.items()
                },
                "moments_stream": {
                    "bytes": s.moments.term.bytes if s.moments.term else 0,
                    "seconds": s.moments.seconds,
                    "train_seconds": s.moments.train_seconds,
                    "visible_seconds": s.moments.visible,  # null: the train's seconds are unknown
                    "restore_seconds": s.restore_with_stream,
                },
            }
            for s in stages
        ],
        "not_modelled": NOT_MODELLED,
        "published": [
            {"phase": f.phase, "seconds": f.seconds, "what": f.what, "source": f.source}
            for f in published(p.model.name).values()
        ],
    }
