"""A series as one line of block characters: `colocate run`'s reward curve and `colocate trace
summarize`'s per-step phase times. Here, below the job and the CLI, so both draw it one way."""

from __future__ import annotations

from collections.abc import Sequence

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], missed: Sequence[int] | None = None) -> str:
    """One character a value, scaled from the lowest to the highest. A missing value (None) is a
    blank, or × where `missed` counts attempts for it that did not run (refused or failed). It
    carries no numbers: print them beside."""
    marks = missed if missed is not None else [0] * len(values)
    if len(marks) != len(values):
        raise ValueError(f"{len(values)} values but {len(marks)} counts of missed attempts")
    ran = [v for v in values if v is not None]
    low, high = min(ran, default=0.0), max(ran, default=0.0)
    top = len(BARS) - 1
    return "".join(
        ("×" if r else " ") if v is None else BARS[round((v - low) / ((high - low) or 1.0) * top)]
        for v, r in zip(values, marks, strict=True)
    )
