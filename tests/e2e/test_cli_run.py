"""`colocate run` as a user runs it: real Megatron-core ranks on Ray, a real transformers engine."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import CYCLE, run

pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("run")
    result = {}
    for mode in ("rematerialize", "backup"):
        path = out / f"{mode}.json"
        done = run("run", "--steps", "3", "--ranks", "2", "--mode", mode, "--report", str(path))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "engine matches trainer" in done.stdout
        result[mode] = json.loads(path.read_text())
    return result


@pytest.mark.parametrize("mode", ["rematerialize", "backup"])
def test_every_step_walks_the_cycle_in_order(reports: dict[str, dict], mode: str) -> None:
    report = reports[mode]
    assert report["mode"] == mode and report["ranks"] == 2
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert all(s["phases"] == CYCLE for s in report["steps"])
    assert set(report["steps"][0]["phase_seconds"]) == {
        "pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["rematerialize", "backup"])
def test_restores_verified_and_versions_increase(reports: dict[str, dict], mode: str) -> None:
    steps = reports[mode]["steps"]
    assert [s["restore_verified"] for s in steps] == [True, True, None]  # --verify-cycles 2
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(set(versions)) and versions[0] == 1
    assert reports[mode]["engine_matches_trainer"] is True


def test_rematerialize_pins_under_one_percent_of_backup(reports: dict[str, dict]) -> None:
    remat = reports["rematerialize"]["host_pinned_bytes_per_rank"]
    backup = reports["backup"]["host_pinned_bytes_per_rank"]
    assert backup >= reports["backup"]["param_bytes_bf16_per_rank"]
    assert remat <= 0.01 * backup


def test_bad_values_are_clear_errors() -> None:
    for args, words in (
        (("--steps", "0"), "--steps must be at least 1"),
        (("--ranks", "0"), "--ranks must be at least 1"),
        (("--mode", "lazy"), "'lazy' is not one of"),
        (("--report", "/nonexistent-dir/r.json"), "folder /nonexistent-dir does not exist"),
    ):
        done = run("run", *args, timeout=60)
        assert done.returncode != 0
        assert words in " ".join(done.stderr.split()), done.stderr
