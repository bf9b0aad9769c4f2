"""Each guard accepts and refuses, and says why."""

from __future__ import annotations

import pytest

from guards import GUARDS, cycle, engine, memory, trainer
from guards.bitexact import restore_bit_identical
from guards.config import CHECKS, violations
from guards.verdict import Verdict, evaluate, refusals
from states import EngineMemory, MemoryBudget, Mode, Region, Snapshot, Source, TrainerLayout, TrainingSetup
from tests.support.snapshots import snap

# guard, a snapshot it accepts, a snapshot it refuses, words the refusal must contain
CASES = [
    (trainer.trainer_resident, snap(paused=frozenset()), snap(), "paused"),
    (trainer.sync_source_resident, snap(), snap(paused=frozenset(Region)), "param buffer is paused"),
    (trainer.sync_source_resident, snap(), snap(extras_stashed=False), "extras backup is not current"),
    (
        trainer.sync_source_resident,
        snap(),
        snap(layout=TrainerLayout(sync_sources={"rogue": Source.ELSEWHERE})),
        "rogue",
    ),
    (trainer.restore_coverage, snap(), snap(layout=TrainerLayout(uncovered=("frozen.w",))), "frozen.w"),
    (trainer.params_dropped, snap(paused=frozenset(Region)), snap(), "OOM"),
    (trainer.params_valid, snap(params_valid=True), snap(), "not cast(mains)"),
    (engine.engine_attached, snap(), snap(engine_attached=False), "no rollout engine"),
    (engine.engine_attached, snap(), snap(mode=Mode.TRAIN_ONLY), "train-only"),
    (engine.engine_idle, snap(), snap(engine_idle=False), "in flight"),
    (engine.engine_synced, snap(), snap(engine_synced=False), "first weight sync"),
    (engine.engine_synced, snap(), snap(engine_version=1), "serves version 1"),
    (engine.engine_version_known, snap(), snap(engine_synced=False), "not known"),
    (engine.engine_version_known, snap(), snap(engine_version=1), "serves version 1"),
    (
        engine.engine_version_known,
        snap(engine_attached=False, engine_synced=False),
        snap(engine_synced=False),
        "no sync",
    ),
    (engine.cache_flushed, snap(), snap(cache_flushed=False), "stale"),
    (engine.version_increasing, snap(), snap(engine_version=3), "does not exceed"),
    (engine.engine_kv_released, snap(), snap(engine_resident=frozenset({EngineMemory.KV_CACHE})), "kv_cache"),
    (
        engine.engine_weights_resident,
        snap(engine_resident=frozenset({EngineMemory.WEIGHTS})),
        snap(),
        "unmapped",
    ),
    (cycle.weights_changed, snap(), snap(trained_since_sync=False), "critic-only"),
    (cycle.weights_unchanged, snap(trained_since_sync=False), snap(), "must be pushed"),
    (  # tests/unit/test_plan_guard.py covers each row of the memory guard
        memory.memory_fits,
        snap(memory=MemoryBudget(device_free=10, engine={EngineMemory.WEIGHTS: 10})),
        snap(memory=MemoryBudget(device_free=9, engine={EngineMemory.WEIGHTS: 10})),
        "needs 10 bytes",
    ),
]


@pytest.mark.parametrize(("check", "good", "bad", "words"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_guard_accepts_and_refuses_with_reason(check, good: Snapshot, bad: Snapshot, words: str) -> None:
    accepted, refused = check(good), check(bad)
    assert accepted == Verdict(check.__name__, True, "ok")
    assert not refused.ok and refused.guard == check.__name__
    assert words in refused.reason


def test_every_registered_guard_is_covered() -> None:
    assert {case[0].__name__ for case in CASES} == set(GUARDS)


def test_guards_compose_and_report_every_refusal() -> None:
    bad = snap(engine_idle=False, cache_flushed=False)
    verdicts = evaluate([engine.engine_idle, engine.cache_flushed, engine.engine_synced], bad)
    assert [v.guard for v in refusals(verdicts)] == ["engine_idle", "cache_flushed"]


def test_first_sync_is_not_fenced() -> None:
    assert cycle.weights_changed(snap(engine_synced=False, trained_since_sync=False, engine_version=None)).ok


def test_bit_identity_names_differing_and_missing_tensors() -> None:
    assert restore_bit_identical({"a": "1", "b": "2"}, {"a": "1", "b": "2"}).ok
    verdict = restore_bit_identical({"a": "1", "b": "2"}, {"a": "1", "b": "X", "c": "3"})
    assert not verdict.ok and "b" in verdict.reason and "c" in verdict.reason


EXCLUSIONS = {
    "colocated": {"colocate": False},
    "trainer_offloads": {"offload_train": False},
    "distributed_optimizer": {"distributed_optimizer": False},
    "advantages_computed": {"compute_advantages": False},
    "no_lora": {"lora": True},
    "optimizer_enabled": {"optimizer_disabled": True},
    "no_old_actor_copy": {"keep_old_actor": True},
    "no_overlap_param_gather": {"overlap_param_gather": True},
    "optimizer_casts_mains": {"precision_aware_optimizer": True},
    "not_debug_train_only": {"debug_train_only": True},
}


@pytest.mark.parametrize("name", sorted(EXCLUSIONS))
def test_each_rematerialize_config_rule_refuses(name: str) -> None:
    found = violations(Mode.REMATERIALIZE, TrainingSetup(**EXCLUSIONS[name]))  # type: ignore[arg-type]
    assert [v.guard for v in found] == [name]
    assert found[0].reason


def test_config_rules_cover_every_check() -> None:
    assert {c.__name__ for c in CHECKS[Mode.REMATERIALIZE]} == set(EXCLUSIONS)


def test_precision_aware_optimizer_with_cpu_offload_is_allowed() -> None:
    setup = TrainingSetup(precision_aware_optimizer=True, optimizer_cpu_offload=True)
    assert violations(Mode.REMATERIALIZE, setup) == ()
    assert violations(Mode.BACKUP, TrainingSetup(lora=True)) == ()
