"""Trace files summarized: per-phase timings, bytes and refusals over the steps of a run, as a Rich table."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.table import Table

from orchestrator.cli.traces.model import SPARK_STEPS, Step, Traces, number_ranges
from orchestrator.telemetry import semconv
from orchestrator.telemetry.semconv import LIFECYCLE_PREFIX, RANK_PREFIX
from orchestrator.telemetry.sparkline import sparkline


@dataclass(frozen=True)
class PhaseSummary:
    """One lifecycle event across steps. Refused and failed attempts count in `refused` and
    `failed`, and in nothing else: not in the durations, the ranks' times or the bytes."""

    event: str
    durations_ms: tuple[float | None, ...]  # per step; None where the step did not run it
    refused: tuple[int, ...]  # per step: attempts the table or a guard refused
    failed: tuple[int, ...]  # per step: attempts whose action raised
    rank_ms: dict[int, float]  # per trainer rank: busy time in its rank.* spans, mean per step run
    bytes: dict[str, int]  # per kind (moved, freed, ...): mean per step run

    @property
    def ran(self) -> list[float]:
        return [d for d in self.durations_ms if d is not None]

    @property
    def p50_ms(self) -> float | None:
        return percentile(self.ran, 0.50)

    @property
    def p95_ms(self) -> float | None:
        return percentile(self.ran, 0.95)

    @property
    def slowest_rank(self) -> tuple[int, float] | None:
        """The rank that took longest, and by how many ms per step it trails the fastest; None
        unless two ranks or more worked in the phase (work only rank 0 does has no slowest)."""
        if len(self.rank_ms) < 2:
            return None
        rank = max(self.rank_ms, key=lambda r: (self.rank_ms[r], -r))
        return rank, self.rank_ms[rank] - min(self.rank_ms.values())

    def to_json(self) -> dict[str, Any]:
        slowest = self.slowest_rank
        return {
            "event": self.event,
            "durations_ms": [_ns(d) for d in self.durations_ms],
            "p50_ms": _ns(self.p50_ms),
            "p95_ms": _ns(self.p95_ms),
            "refused": list(self.refused),
            "failed": list(self.failed),
            "rank_ms_per_step": {str(r): _ns(ms) for r, ms in sorted(self.rank_ms.items())},
            "slowest_rank": None if slowest is None else {"rank": slowest[0], "over_fastest_ms": _ns(slowest[1])},
            "bytes_per_step": self.bytes,
        }


@dataclass(frozen=True)
class Summary:
    steps: tuple[int, ...]
    step_ms: tuple[float, ...]
    wall_ms: float  # first step's start to last step's end
    phases: tuple[PhaseSummary, ...]
    rootless: int

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "step_ms": [_ns(ms) for ms in self.step_ms],
            "wall_ms": _ns(self.wall_ms),
            "rootless_traces": self.rootless,
            "phases": [p.to_json() for p in self.phases],
        }


def _ns(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 6)  # spans are timed in ns: more digits are float noise


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered, position = sorted(values), q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(traces: Traces) -> Summary:
    steps = traces.steps
    events = _event_order(steps)
    durations: dict[str, list[float | None]] = {e: [None] * len(steps) for e in events}
    refused: dict[str, list[int]] = {e: [0] * len(steps) for e in events}
    failed: dict[str, list[int]] = {e: [0] * len(steps) for e in events}
    rank_ms: dict[str, dict[int, float]] = {e: defaultdict(float) for e in events}
    byte_sums: dict[str, dict[str, int]] = {e: defaultdict(int) for e in events}
    for i, step in enumerate(steps):
        busy = _rank_busy_ms(step)
        for phase in step.phases:
            event = phase.name.removeprefix(LIFECYCLE_PREFIX)
            if phase.refused or phase.failed:
                (refused if phase.refused else failed)[event][i] += 1
                continue
            durations[event][i] = (durations[event][i] or 0.0) + phase.duration_ms
            for rank, ms in busy.get(phase.span_id, {}).items():
                rank_ms[event][rank] += ms
            for kind, key in semconv.BYTES_BY_KIND.items():
                moved = phase.attributes.get(key)
                if isinstance(moved, int) and not isinstance(moved, bool):
                    byte_sums[event][kind] += moved
    phases = []
    for event in events:
        runs = sum(d is not None for d in durations[event]) or 1
        phases.append(
            PhaseSummary(
                event=event,
                durations_ms=tuple(durations[event]),
                refused=tuple(refused[event]),
                failed=tuple(failed[event]),
                rank_ms={r: ms / runs for r, ms in rank_ms[event].items()},
                bytes={k: v // runs for k, v in byte_sums[event].items()},
            )
        )
    wall = (max(s.root.end_ns for s in steps) - steps[0].root.start_ns) / 1e6
    numbers = tuple(s.number for s in steps)
    return Summary(numbers, tuple(s.root.duration_ms for s in steps), wall, tuple(phases), traces.rootless)


def _event_order(steps: Sequence[Step]) -> list[str]:
    """Events in the order a step runs them: by their mean place among its phases, then by their
    mean start (a fault that ended a step sits after the phase it ended, however long steps are)."""
    places: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for step in steps:
        for place, phase in enumerate(step.phases):
            places[phase.name.removeprefix(LIFECYCLE_PREFIX)].append((place, step.offset_ms(phase.start_ns)))
    return sorted(places, key=lambda e: tuple(sum(x) / len(places[e]) for x in zip(*places[e], strict=True)))


def _rank_busy_ms(step: Step) -> dict[str, dict[int, float]]:
    """Per lifecycle span id, per rank: the time covered by that rank's rank.* spans under it.

    Covered time, not a sum of durations, so a rank.bucket nested in rank.push_weights counts once.
    """
    intervals: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for span in step.spans:
        phase = step.phase_of(span) if span.name.startswith(RANK_PREFIX) else None
        if phase is not None and span.rank is not None:
            intervals[(phase.span_id, span.rank)].append((span.start_ns, span.end_ns))
    busy: dict[str, dict[int, float]] = defaultdict(dict)
    for (phase_id, rank), spans in intervals.items():
        covered, reach = 0, None
        for start, end in sorted(spans):
            start = max(start, reach or start)
            covered += max(0, end - start)
            reach = max(end, reach or end)
        busy[phase_id][rank] = covered / 1e6
    return busy


def summary_table(summary: Summary, columns_up_to: int = 3) -> Table:
    """One row per lifecycle event; a column per step when there are at most `columns_up_to` steps.

    Sized for 80 columns (a pipe's width): bytes use their own short units and never wrap."""
    table = Table(
        title="colocate trace: lifecycle phases, ms",
        caption="slowest: the busiest trainer rank, its lead over the fastest (ms/step)",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    table.add_column("phase", no_wrap=True)
    per_step = len(summary.steps) <= columns_up_to
    for number in summary.steps if per_step else ():
        table.add_column(f"step {number}", justify="right", no_wrap=True)
    if not per_step:
        shown = min(len(summary.steps), SPARK_STEPS)
        table.add_column("per step" if shown == len(summary.steps) else f"last {shown} steps", no_wrap=True)
    table.add_column("p50", justify="right", no_wrap=True)
    table.add_column("p95", justify="right", no_wrap=True)
    table.add_column("slowest", no_wrap=True)
    table.add_column("bytes/step", no_wrap=True)
    for phase in summary.phases:
        if per_step:
            steps = [_ms(*ran) for ran in zip(phase.durations_ms, phase.refused, phase.failed, strict=True)]
        else:
            missed = [r + f for r, f in zip(phase.refused, phase.failed, strict=True)]
            steps = [sparkline(phase.durations_ms[-SPARK_STEPS:], missed[-SPARK_STEPS:])]
        slowest = phase.slowest_rank
        lead = "-" if slowest is None else f"{slowest[0]} +{_digits(slowest[1])}"
        moved = "\n".join(f"{kind} {_size(n)}" for kind, n in phase.bytes.items() if n) or "-"  # a kind a line
        table.add_row(phase.event, *steps, _ms(phase.p50_ms), _ms(phase.p95_ms), lead, moved)
    return table


def summary_line(summary: Summary) -> str:
    mean = sum(summary.step_ms) / len(summary.step_ms)
    line = f"{len(summary.steps)} step(s) ({number_ranges(list(summary.steps))}), wall {summary.wall_ms / 1e3:.3f} s"
    line += f", mean step {mean:.1f} ms"
    return line + (f"; {summary.rootless} trace(s) without a step span ignored" if summary.rootless else "")


def _ms(value: float | None, refused: int = 0, failed: int = 0) -> str:
    missed = ", ".join(f"{n} {what}" for n, what in ((refused, "refused"), (failed, "failed")) if n)
    if value is None:
        return missed or "-"
    return _digits(value) + (f" ({missed})" if missed else "")


def _digits(ms: float) -> str:
    """A tenth of a ms below a second, whole ms above it: at most 5 characters up to 100 s."""
    return f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _size(n: int) -> str:
    """At most 5 characters: 812B, 147K, 1.15M, 12.3G (binary units)."""
    size, unit = float(n), "B"
    for unit in ("B", "K", "M", "G"):
        if size < 1024 or unit == "G":
            break
        size /= 1024
    if unit == "B":
        return f"{n}B"
    return f"{size:.2f}{unit}" if size < 10 else f"{size:.1f}{unit}" if size < 100 else f"{size:.0f}{unit}"
