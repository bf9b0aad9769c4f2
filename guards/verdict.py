"""Verdicts, and the `guard` decorator that turns a refusal reason into one."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Verdict:
    """One guard's answer: `ok`, and in any case which guard said it and why."""

    guard: str
    ok: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.guard}: {self.reason}"


Check = Callable[[T], Verdict]


def guard(fn: Callable[[T], str | None]) -> Callable[[T], Verdict]:
    """Name a check after its function. The check returns the refusal reason, or None to admit."""

    @functools.wraps(fn)
    def check(subject: T) -> Verdict:
        reason = fn(subject)
        return Verdict(fn.__name__, reason is None, reason or "ok")

    return check


def evaluate(checks: Iterable[Callable[[T], Verdict]], subject: T) -> tuple[Verdict, ...]:
    """Run every check (no short-circuit), so a refusal lists every reason at once."""
    return tuple(check(subject) for check in checks)


def refusals(verdicts: Iterable[Verdict]) -> tuple[Verdict, ...]:
    return tuple(v for v in verdicts if not v.ok)


def names(items: Iterable[str], limit: int = 5) -> str:
    """`a, b, c and 7 more`: enough names to act on, never a wall of them."""
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"
