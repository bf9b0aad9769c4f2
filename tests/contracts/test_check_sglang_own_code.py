"""`colocate check`'s engine group against sglang 0.5.23's own HTTP app (the contract tier:
scripts/sglang-contract-tier.sh; skipped where sglang does not import).

What runs is SGLang's: /server_info built by its `build_server_info` from its `ServerArgs` (as
SGLang parses docs/sglang.md's launch command), /model_info from its app, /ready from its
`TokenizerManager.is_ready`. What is replaced is tests/support/sglang_tier.py's seam (the model
runner, the ZMQ hop; no scheduler sized a KV pool, so `internal_states` has no `memory_usage` and
the fit is the plan's KV pool at the server's `mem_fraction_static`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed: the contract tier, scripts/sglang-contract-tier.sh", allow_module_level=True)

import requests

from orchestrator.cli.plan.options import PlanOptions
from orchestrator.job.check import Outcome, Row, SetUp
from orchestrator.job.check.engine import rows
from tests.support import sglang_tier as tier

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from typer.testing import CliRunner

    from orchestrator.cli.app import app

    folder = tmp_path_factory.mktemp("model")
    done = CliRunner().invoke(app, ["engine-config", str(folder), "--force"])
    assert done.exit_code == 0, done.output
    return folder


def checked(url: str) -> dict[str, Row]:
    setup = SetUp(plan=PlanOptions(model="tiny").plan(), model="tiny", engines=(url,))
    return {row.check: row for row in rows(setup)}


def test_a_server_started_as_docs_sglang_says_passes_on_sglangs_own_answers(model_folder: Path) -> None:
    with tier.sglang_app(model_folder) as served:
        found = checked(served.url)
        requested = [route for route, _ in served.tokenizer.requests]
    for name in ("reachable", "version", "memory saver", "memory fit", "served config", "paused", "layout"):
        assert found[name].outcome is Outcome.OK, found[name]
    assert f"sglang {tier.VERSION}" in found["version"].read
    assert "mem_fraction_static" in found["memory fit"].read and str(model_folder) in found["served config"].read
    assert requested == []  # nothing reached SGLang's handlers that change state


def test_sglangs_server_args_without_the_memory_saver_fail(model_folder: Path) -> None:
    with tier.sglang_app(model_folder, enable_memory_saver=False) as served:
        row = checked(served.url)["memory saver"]
    assert row.outcome is Outcome.FAIL and "enable_memory_saver is False" in row.read
    assert row.fix and "--enable-memory-saver" in row.fix


def test_sglangs_mem_fraction_static_is_the_one_judged(model_folder: Path) -> None:
    with tier.sglang_app(model_folder, mem_fraction_static=0.7) as served:
        row = checked(served.url)["memory fit"]
    assert row.outcome is Outcome.OK and "mem_fraction_static 0.7 (the plan was given 0.8)" in row.read


def test_a_server_sglang_paused_answers_503_on_ready_and_warns(model_folder: Path) -> None:
    with tier.sglang_app(model_folder) as served:
        paused = requests.post(f"{served.url}/pause_generation", json={"mode": "retract"}, timeout=10)
        assert paused.status_code == 200, paused.text
        row = checked(served.url)["paused"]
    assert row.outcome is Outcome.WARN and "/ready answers 503" in row.read
