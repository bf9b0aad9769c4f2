"""`colocate plan`'s time model through its command line: the table and its bounds, `--json`'s
`timing`, the rate options, and `--measure` where there is no CUDA GPU (exit 2, naming why)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from orchestrator.cli.app import app
from orchestrator.plan.figures import PUBLISHED

GLM5 = ("glm-5", "--tp", "8", "--pp", "4", "--ep", "16", "--etp", "1", "--dp", "2", "--pp-layers", "19,20,20,19")
PHASES = {"pause_grads", "update_weights", "drop_params", "restore"}


def colocate(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def timing(*args: str) -> dict[str, Any]:
    done = colocate("plan", *args, "--json")
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)["timing"]


def test_glm5_prints_the_prediction_beside_the_seeds_figures_with_each_bound() -> None:
    done = colocate("plan", *GLM5, "--gpus-per-node", "4")
    assert done.exit_code == 0, done.output
    out = done.stdout
    assert "predicted seconds per phase" in out and "published" in out
    for f in PUBLISHED:
        assert f"{f.phase} {f.seconds:g} s, {f.what}" in out
    assert "update_weights: InfiniBand:" in out
    assert "pause_grads: pinned device->host:" in out and "restore: pinned host->device:" in out
    assert "drop_params: nothing crosses a link" in out
    assert "give --train-seconds" in out


def test_the_json_timing_object_has_every_phase_its_bound_and_terms() -> None:
    t = timing(*GLM5, "--gpus-per-node", "4", "--train-seconds", "1.5")
    assert set(t["rates"]) == {"source", "to_host", "from_host", "device", "nvlink", "ib"}
    assert [f["seconds"] for f in t["published"]] == [4.8, 73.8]
    assert len(t["stages"]) == 4
    for st in t["stages"]:
        assert set(st["phases"]) == PHASES
        for name, x in st["phases"].items():
            assert x["seconds"] == pytest.approx(sum(term["seconds"] for term in x["terms"]), rel=1e-12)
            if x["terms"]:
                assert x["bound"] == max(x["terms"], key=lambda term: term["seconds"])
            else:
                assert name == "drop_params" and x["bound"] is None
        m = st["moments_stream"]
        assert m["train_seconds"] == 1.5 and m["visible_seconds"] == pytest.approx(max(0.0, m["seconds"] - 1.5))
    assert timing("llama-1b")["published"] == []  # no published figure at llama-1b
    assert timing("llama-1b")["stages"][0]["moments_stream"]["visible_seconds"] in (0.0, None)


def test_rate_options_reach_the_prediction_and_bad_ones_exit_2_naming_each() -> None:
    base = timing("qwen3-4b", "--tp", "2", "--dp", "2", "--gpus-per-node", "2", "--offload", "always")
    fast = timing("qwen3-4b", "--tp", "2", "--dp", "2", "--gpus-per-node", "2", "--offload", "always",
                  "--ib-gbps", "100", "--pcie-gbps", "25")  # fmt: skip
    assert fast["rates"]["ib"]["gbps"] == 100 and fast["rates"]["to_host"]["gbps"] == 25
    assert fast["rates"]["source"] != base["rates"]["source"]
    pause = [s["stages"][0]["phases"]["pause_grads"]["seconds"] for s in (base, fast)]
    assert pause[1] == pytest.approx(2 * pause[0], rel=1e-12)  # 50 GB/s -> 25
    done = colocate("plan", "llama-1b", "--nvlink-gbps", "0", "--ib-gbps", "-1", "--train-seconds", "-2")
    assert done.exit_code == 2
    for says in ("--nvlink-gbps must be a positive rate", "--ib-gbps must be a positive rate", "--train-seconds"):
        assert says in done.output


def test_measure_without_a_cuda_gpu_exits_2_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    done = colocate("plan", "llama-1b", "--measure")
    assert done.exit_code == 2
    assert "--measure needs a CUDA GPU and this machine has none" in done.output


def test_measure_without_torch_exits_2_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    done = colocate("plan", "llama-1b", "--measure")
    assert done.exit_code == 2
    assert "--measure needs torch with CUDA, and torch is not installed here" in done.output
