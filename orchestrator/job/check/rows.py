"""One row of `colocate check`, the set-up every check reads, and the run of them all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from orchestrator.plan.memory import Plan
from states import TrainingSetup


class Outcome(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"  # could not be judged here (no GPU, no engine given): never a silent pass


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One check's verdict: `read` is what it looked at, `fix` the one-line remedy of a failure
    (or a warning)."""

    group: str  # memory, engine, conversion, set-up, runtime
    check: str
    outcome: Outcome
    read: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.outcome is Outcome.FAIL and not self.fix:
            raise ValueError(f"check {self.check!r} failed without naming the fix")

    def as_json(self) -> dict[str, str | None]:
        return {
            "group": self.group,
            "check": self.check,
            "outcome": self.outcome.value,
            "read": self.read,
            "fix": self.fix,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class SetUp:
    """What `colocate check` is told of the run to come: the plan of its model and layout (the
    options of `colocate plan`), the trainer's set-up the mode's guards read, the SGLang servers
    it will drive, and the Ray cluster."""

    plan: Plan
    model: str  # as given: a built-in name or a config.json
    training: TrainingSetup = field(default_factory=TrainingSetup)
    engines: tuple[str, ...] = ()  # base URLs of the SGLang servers
    ray_address: str | None = None
    saves: bool = False  # the run saves checkpoints: count what a save stages in host memory


Check = Callable[[SetUp], Sequence[Row]]


def group_name(group: Check) -> str:
    """A group by its module's name: memory, engine, conversion, refusals, runtime."""
    return getattr(group, "__module__", "").rsplit(".", 1)[-1] or repr(group)


def run_checks(setup: SetUp, groups: Sequence[Check], on_group: Callable[[str], None] | None = None) -> list[Row]:
    """Every row of every group, in order; `on_group(name)` before each (a progress line). A
    group that raises is one failed row naming it: a check that cannot run says so, it does not
    end the others."""
    rows: list[Row] = []
    for group in groups:
        name = group_name(group)
        if on_group is not None:
            on_group(name)
        try:
            rows.extend(group(setup))
        except Exception as exc:  # reported as the row, with its type
            fix = "report this as a bug in colocate check, with the row's text"
            rows.append(Row(group=name, check=name, outcome=Outcome.FAIL, read=f"{type(exc).__name__}: {exc}", fix=fix))
    return rows
