"""`colocate check`'s set-up rows: each config guard of the mode fails for its own reason, with
the guard's words and the fix."""

from __future__ import annotations

from dataclasses import fields

import pytest

from guards.config import CHECKS
from orchestrator.cli.plan.options import PlanOptions
from orchestrator.job.check import refusals
from orchestrator.job.check.rows import Outcome, SetUp
from states import Mode, TrainingSetup
from tests.unit.test_guards import EXCLUSIONS

# Each guard of rematerialize, and a set-up that only it refuses (test_guards' own table), less
# the distributed optimizer, which `colocate check` reads off the plan (below).
REFUSED_BY = {guard: setup for guard, setup in EXCLUSIONS.items() if guard != "distributed_optimizer"}


@pytest.fixture(scope="module")
def remat() -> SetUp:
    return SetUp(plan=PlanOptions(model="qwen3-4b", tp=2).plan(), model="qwen3-4b")


def test_every_guard_has_a_fix() -> None:
    assert {check.__name__ for checks in CHECKS.values() for check in checks} == set(refusals.FIXES)


def test_the_supported_set_up_is_admitted_in_one_row_naming_every_guard(remat: SetUp) -> None:
    (row,) = refusals.rows(remat)
    assert row.outcome is Outcome.OK and row.check == "the mode's refusals"
    names = [c.__name__ for c in CHECKS[Mode.REMATERIALIZE]]
    assert row.read == f"rematerialize's {len(names)} guard(s) admit it: {', '.join(names)}"


@pytest.mark.parametrize("guard", sorted(REFUSED_BY))
def test_each_guard_fails_for_its_own_reason(remat: SetUp, guard: str) -> None:
    training = TrainingSetup(**REFUSED_BY[guard])  # type: ignore[arg-type]
    rows = {r.check: r for r in refusals.rows(SetUp(plan=remat.plan, model=remat.model, training=training))}
    failed = [name for name, r in rows.items() if r.outcome is Outcome.FAIL]
    assert failed == [guard]
    (verdict,) = [v for c in CHECKS[Mode.REMATERIALIZE] if (v := c(training)).guard == guard]
    assert rows[guard].read == f"rematerialize: {verdict.reason}"
    assert rows[guard].fix == refusals.FIXES[guard]


def test_the_distributed_optimizer_is_the_plan_s() -> None:
    # Under backup the plan may drop it; the set-up's own copy is not read: the plan's is.
    plan = PlanOptions(model="qwen3-4b", tp=2, mode="backup", distributed_optimizer=False).plan()
    rows = refusals.rows(SetUp(plan=plan, model="qwen3-4b", training=TrainingSetup(debug_train_only=True)))
    assert (rows[0].check, rows[0].outcome) == ("not_debug_train_only", Outcome.FAIL)
    assert all(r.outcome is Outcome.OK for r in rows[1:])
    assert "distributed_optimizer" in {f.name for f in fields(TrainingSetup)}
