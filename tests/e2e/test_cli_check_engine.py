"""`colocate check` before `colocate run`, against the stand-in servers of a two-server job
(tests/support/sglang_server.py in processes of their own, as tests/e2e/test_cli_sglang.py runs
them: SGLang's HTTP API over a real transformers Llama; what SGLang itself does beyond that is
not here). The check's verdicts are held to what the run then does: what it passes, the run does
not refuse for; what it fails, the run refuses for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run, sglang_stand_ins

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

JUDGED = ("reachable", "version", "memory saver", "memory fit", "served config", "layout")


def check(urls: list[str]) -> tuple[int, dict[tuple[str, str], dict[str, str]]]:
    servers = [arg for url in urls for arg in ("--engine", url)]
    done = run("check", "tiny", "--dp", "2", *servers, "--json")  # the run's layout: --ranks 2
    rows = json.loads(done.stdout)["rows"]
    return done.returncode, {(row["read"].split(": ", 1)[0], row["check"]): row for row in rows}


def colocate_run(urls: list[str]) -> str:
    servers = [arg for url in urls for arg in ("--engine-url", url)]
    done = run("run", "--engine", "sglang", *servers, "--ranks", "2", "--steps", "1")
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_what_the_check_passes_the_run_does_not_refuse(tmp_path: Path) -> None:
    with sglang_stand_ins(tmp_path / "model", count=2) as urls:
        code, rows = check(urls)
        assert code == 0, rows
        for url in urls:
            assert all(rows[(url, name)]["outcome"] == "ok" for name in JUDGED[:-1]), rows
        assert [r["outcome"] for r in rows.values() if r["group"] == "conversion"] == ["ok"] * 5
        assert colocate_run(urls) == ""


def test_a_server_without_the_memory_saver_fails_the_check_and_the_run_refuses_it(tmp_path: Path) -> None:
    with sglang_stand_ins(tmp_path / "model", count=2, changed=[[], ["--disable-memory-saver"]]) as urls:
        code, rows = check(urls)
        assert code == 1
        assert (
            rows[(urls[1], "memory saver")]["outcome"] == "fail" and rows[(urls[0], "memory saver")]["outcome"] == "ok"
        )
        refused = colocate_run(urls)
    assert urls[1] in refused and "started without --enable-memory-saver" in refused, refused


def test_a_server_serving_another_width_fails_the_check_and_the_run_cannot_load_it(tmp_path: Path) -> None:
    other = tmp_path / "wider"
    assert run("engine-config", str(other)).returncode == 0
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"intermediate_size": 2 * config["intermediate_size"]}))
    with sglang_stand_ins(tmp_path / "model", count=2, changed=[[], ["--model-path", str(other)]]) as urls:
        code, rows = check(urls)
        assert code == 1
        served = rows[(urls[1], "served config")]
        assert served["outcome"] == "fail" and "intermediate_size is" in served["read"], served
        assert rows[(urls[0], "served config")]["outcome"] == "ok"
        refused = colocate_run(urls)
    assert refused and "down_proj" in refused, refused
