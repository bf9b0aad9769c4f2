"""`colocate run --device cuda` on a GPU: the rank trains over NCCL with torch_memory_saver regions.

Two engines: the transformers Llama on the same GPU, and a server speaking SGLang's HTTP API (the
contract stand-in, tests/support/sglang_server.py, serving a transformers Llama on the GPU in a
process of its own) that receives every weight bucket as a CUDA IPC handle carrying the device
UUID, as SGLang's patched torch reductions do. SGLang itself is not installed here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.cli import CYCLE, run, sglang_stand_ins
from tests.support.rewards import reward_rise, rise_needed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
STEPS = 12


def learned(report: dict) -> bool:
    """The last 3 steps' mean reward is above the first 3's by more than 6 standard deviations of
    what sampling alone moves it by (tests/support/rewards: 0.027 at --model tiny's 128 x 16 x 4
    positions a step); a tiny run on two H200s rose 0.15 by step 12 (benchmarks/run_tiny.ranks2.h200x2.json)."""
    from orchestrator.job.presets import grpo_config  # what `colocate run` trains: --model tiny

    rewards = [s["reward_mean"] for s in report["steps"]]
    return reward_rise(rewards, 3) > rise_needed(grpo_config("tiny"), 3)


def check_cycles(report: dict) -> None:
    steps = report["steps"]
    assert len(steps) == STEPS and all(s["phases"] == CYCLE for s in steps)
    assert [s["restore_verified"] for s in steps[:2]] == [True, True]
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(set(versions))
    assert all(s["bytes_freed_at_drop"] > 0 for s in steps), "torch_memory_saver returned no device memory"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("transformers")
    with sglang_stand_ins(tmp_path_factory.mktemp("model"), device="cuda") as (url,):
        yield url


@pytest.mark.parametrize("mode", ["rematerialize", "backup"])
def test_transformers_engine_on_the_gpu(mode: str, tmp_path: Path) -> None:
    pytest.importorskip("torch_memory_saver")
    path = tmp_path / "report.json"
    done = run("run", "--device", "cuda", "--mode", mode, "--steps", str(STEPS), "--report", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(path.read_text())
    check_cycles(report)
    assert report["engine_matches_trainer"] is True
    assert learned(report), [s["reward_mean"] for s in report["steps"]]


def test_sglang_server_receives_weights_by_cuda_ipc(server: str, tmp_path: Path) -> None:
    pytest.importorskip("torch_memory_saver")
    path = tmp_path / "report.json"
    done = run(
        "run", "--device", "cuda", "--engine", "sglang", "--engine-url", server,
        "--steps", str(STEPS), "--report", str(path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(path.read_text())
    check_cycles(report)
    assert learned(report), [s["reward_mean"] for s in report["steps"]]
