"""`colocate run --model CONFIG.json` for the seed's families, as a user runs it, at tiny widths.

Each config is made by the family's own transformers config class and written as a config.json,
as a user's would be. The run builds the family's Megatron-core model by Megatron's spec functions
(random init), checks it against that config (`served_config`), serves it with the family's own
transformers class built from the same file, and runs every phase of two steps: sync, drop,
rollout (`generate`), restore and train. Nothing is replaced: real Megatron-core DDP and
DistributedOptimizer (gloo), a real transformers engine. DeepSeek-V3 runs its two ranks as Ray
actors, the others in the driver's process.

- Qwen3: tied embeddings and q/k norm.
- DeepSeek-V3: MLA with YaRN, one dense layer and one MoE layer of 8 sigmoid-routed experts in 2
  groups with `expert_bias`, a shared expert and a routed scale.
- GLM-5 (glm_moe_dsa): DeepSeek-V3's attention and experts plus a DSA indexer keeping 4 keys, and
  one MTP layer, which Megatron builds and trains and the engine does not serve (no MTP in rollouts).
  Its published norm eps (1e-5) becomes HF's latent norms' 1e-6, and the summary says so.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.cli import CYCLE, run

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

STEPS = 2
_COMMON = dict(vocab_size=160, hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
_MLA = dict(
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4
)
_ROUTED = dict(
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=128,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
)


def _configs() -> dict[str, Any]:
    return {
        "qwen3": transformers.Qwen3Config(
            **_COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            tie_word_embeddings=True,
        ),
        "deepseek_v3": transformers.DeepseekV3Config(
            **_COMMON,
            **_MLA,
            **_ROUTED,
            n_group=2,
            topk_group=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        "glm_moe_dsa": transformers.GlmMoeDsaConfig(
            **_COMMON,
            **_MLA,
            **_ROUTED,
            n_group=1,
            topk_group=1,
            index_n_heads=4,
            index_head_dim=32,
            index_topk=4,
            num_nextn_predict_layers=1,
            rms_norm_eps=1e-5,
        ),
    }


RANKS = {"qwen3": 1, "deepseek_v3": 2, "glm_moe_dsa": 1}


@pytest.fixture(scope="module", params=sorted(RANKS))
def family_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, dict]:
    family = request.param
    out = tmp_path_factory.mktemp(family)
    config = _configs()[family]
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    (out / "config.json").write_text(config.to_json_string())
    report = out / "report.json"
    args = ["run", "--model", str(out / "config.json"), "--steps", str(STEPS), "--ranks", str(RANKS[family])]
    result = run(*args, "--prompts", "8", "--group-size", "4", "--report", str(report), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return family, result, json.loads(report.read_text())


def test_every_phase_of_every_step_runs(family_run: tuple[str, Any, dict]) -> None:
    _, _, report = family_run
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    for step in report["steps"]:
        assert step["phases"] == CYCLE
        assert 0.0 <= step["reward_mean"] <= 1.0
        assert step["loss"] is not None


def test_restores_are_bit_identical_and_the_engine_holds_the_trained_weights(family_run: tuple[str, Any, dict]) -> None:
    _, _, report = family_run
    assert [s["restore_verified"] for s in report["steps"]] == [True] * STEPS
    assert [s["engine_matches_trainer"] for s in report["steps"]] == [True] * STEPS


def test_the_summary_names_the_model_its_params_and_what_changed(family_run: tuple[str, Any, dict]) -> None:
    from orchestrator.job.models import family_model
    from orchestrator.plan.model import hf_params, mtp_params

    family, result, report = family_run
    assert f"({family}," in report["model"]
    shape = family_model(_configs()[family].to_dict()).model  # what the job serves, MTP left out but GLM-5's
    # the planner's count of what the job builds: the HF model's params and the MTP layer's (Megatron
    # builds it), the vocabulary unpadded (GPTModel takes it as given)
    assert report["params_per_rank"] == hf_params(shape) + mtp_params(shape)
    if family == "glm_moe_dsa":
        assert "rms_norm_eps 1e-05 → 1e-06" in report["model"]
    assert "params per rank" in result.stdout and f"{report['params_per_rank']:,}" in result.stdout
