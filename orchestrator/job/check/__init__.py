"""`colocate check`: a preflight of the user's real set-up, before a run starts.

Each group of checks reads one part of the set-up (this machine's memory, the engine servers,
the conversion, the mode's refusals, the runtime) and returns rows: a verdict, what it read,
and for a failure the fix in one line. Nothing is changed on any server or on the machine."""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.job.check import conversion, engine, memory, refusals, runtime
from orchestrator.job.check.rows import Check, Outcome, Row, SetUp, run_checks

# The groups, in the order the table shows them.
GROUPS: tuple[Check, ...] = (memory.rows, engine.rows, conversion.rows, refusals.rows, runtime.rows)


def check(setup: SetUp, on_group: Callable[[str], None] | None = None) -> list[Row]:
    """Every row of every group; `on_group(name)` before each."""
    return run_checks(setup, GROUPS, on_group)


__all__ = ["GROUPS", "Check", "Outcome", "Row", "SetUp", "check", "run_checks"]
