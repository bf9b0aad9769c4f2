"""`colocate run --tp 2` as a user runs it: two real Megatron-core ranks on Ray (gloo, CPU), one
TP group holding half of every layer each, and a real transformers engine holding the whole model.

The one run serves every assertion: each restore checked bit-identical on both ranks, the engine
holding exactly the trainer's weights after every update (the conversion gathers the TP shards;
only the sync source sends, so the engine receives each HF tensor once), and a reward each step.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.support.cli import CYCLE, run

pytest.importorskip("megatron.core")
pytest.importorskip("ray")

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path_factory.mktemp("tp") / "report.json"
    args = ["--ranks", "2", "--tp", "2", "--steps", str(STEPS), "--verify-cycles", str(STEPS)]
    done = run("run", *args, "--prompts", "8", "--group-size", "4", "--report", str(report), timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(report.read_text())


def test_every_restore_is_verified_and_the_engine_matches_the_trainer_each_step(tp_run: Any) -> None:
    _, report = tp_run
    steps = report["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["phases"] == CYCLE for s in steps)
    assert [s["restore_verified"] for s in steps] == [True] * STEPS
    assert [s["engine_matches_trainer"] for s in steps] == [True] * STEPS
    assert report["engine_matches_trainer"] is True


def test_a_reward_and_a_loss_are_recorded_each_step(tp_run: Any) -> None:
    _, report = tp_run
    for step in report["steps"]:
        assert 0.0 <= step["reward_mean"] <= 1.0
        assert step["loss"] is not None


def test_each_rank_holds_its_shard_and_the_engine_receives_the_whole_model_once(tp_run: Any) -> None:
    from orchestrator.job.grpo import GRPOConfig
    from orchestrator.job.presets import param_count

    _, report = tp_run
    model = GRPOConfig().model
    whole = param_count(model)  # type: ignore[arg-type]  # the tiny default, a TinyGPTConfig
    # TP splits every weight but the norms (replicated): 3 norms of 64 per layer and the final one
    norms = (2 * model.num_layers + 1) * model.hidden_size
    assert report["params_per_rank"] == (whole - norms) // 2 + norms
    # bf16 bytes of every HF tensor, once: rank 1, no sync source, sends none
    assert all(s["phase_bytes"]["update_weights"] == 2 * whole for s in report["steps"])


def test_the_summary_names_the_layout(tp_run: Any) -> None:
    done, report = tp_run
    assert report["layout"] == "TP 2 x DP 1"
    assert "2 rank(s) (TP 2 x DP 1)" in done.stdout


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    """`--ep 2` on a tiny Qwen3-MoE config.json (4 experts in each of 2 layers): DP 2, EP 2."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("ep")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=128, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    (folder / "config.json").write_text(config.to_json_string())
    args = ["--model", str(folder / "config.json"), "--ranks", "2", "--ep", "2", "--steps", str(STEPS)]
    report = folder / "report.json"
    done = run("run", *args, "--verify-cycles", str(STEPS), "--prompts", "8", "--group-size", "4",
               "--report", str(report), timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(report.read_text()), config


def test_experts_split_over_ep_restore_verified_and_the_engine_receives_each_once(ep_run: Any) -> None:
    import torch

    report, config = ep_run
    assert report["layout"] == "DP 2, EP 2"
    steps = report["steps"]
    assert [s["restore_verified"] for s in steps] == [True] * STEPS
    assert [s["engine_matches_trainer"] for s in steps] == [True] * STEPS
    with torch.device("meta"):
        hf = __import__("transformers").Qwen3MoeForCausalLM(config)
    whole = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    assert report["params_per_rank"] == whole - experts // 2  # half the experts each, the rest whole
    # Every HF tensor in bf16, once: the expert gather gives the source all of them; rank 1 sends none.
    assert all(s["phase_bytes"]["update_weights"] == 2 * whole for s in steps)
