"""`colocate plan` through its command line (typer's runner, in process): configs of every style
are read, every bad value or option exits 2 naming what is wrong (all at once), and the headline
says what the count includes, leaves out and assumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from orchestrator.cli.app import app
from orchestrator.models import SUPPORT, ModelShape
from orchestrator.plan.model import from_config, padded_vocab
from orchestrator.plan.presets import GLM5, QWEN3_4B
from tests.support.hf_configs import LLAMA4_TEXT, MIXTRAL, QWEN3_VL, SMALL_MLA


def colocate(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def write(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def planned(*args: str) -> dict[str, Any]:
    done = colocate("plan", *args, "--json")
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def test_mixtral_and_llama4_configs_are_planned(tmp_path: Path) -> None:
    mixtral = planned(write(tmp_path, MIXTRAL, "mixtral.json"), "--ep", "2", "--dp", "2")
    assert mixtral["model"]["name"] == "MixtralForCausalLM"
    assert mixtral["parallelism"]["expert_dp"] == 1
    llama4 = planned(write(tmp_path, {**LLAMA4_TEXT, "architectures": ["Llama4ForCausalLM"]}, "l4.json"))
    assert llama4["model"]["total_params"] == llama4["model"]["hf_params"]  # vocab 256: no padding


def test_expert_tp_defaults_to_tp_as_megatron_does_and_the_plan_says_so(tmp_path: Path) -> None:
    """megatron-core's initialize_model_parallel: expert_tensor_parallel_size = TP when not given."""
    config = write(tmp_path, MIXTRAL, "mixtral.json")
    default = planned(config, "--tp", "2")
    etp1 = planned(config, "--tp", "2", "--etp", "1")
    assert default["parallelism"]["etp"] == 2 and default["parallelism"]["etp_is_tp"]
    assert etp1["parallelism"]["etp"] == 1 and not etp1["parallelism"]["etp_is_tp"]
    m = from_config(MIXTRAL, source="mixtral")
    experts = len(m.moe_layers) * m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size
    # ETP 2 holds half of every expert where ETP 1 holds them whole: the rank's params differ by half of them
    assert etp1["stages"][0]["params"] - default["stages"][0]["params"] == experts // 2
    table = colocate("plan", config, "--tp", "2")
    assert "EP1 x ETP2 (= TP: Megatron's default)" in table.stdout.splitlines()[0]
    assert "EP1 x ETP1 (expert DP" in colocate("plan", config, "--tp", "2", "--etp", "1").stdout


def test_a_multimodal_config_keeps_its_top_level_keys_and_names_what_is_not_counted(tmp_path: Path) -> None:
    done = colocate("plan", write(tmp_path / "..", QWEN3_VL, "qwen3-vl.json"))
    assert done.exit_code == 0, done.output
    first, second = done.stdout.splitlines()[:2]
    assert first.startswith("Qwen3VLForConditionalGeneration: 4.02 B params;")  # tied, q/k-normed
    assert second == "not counted: the vision encoder (vision_config) and what joins it to the text model"
    got = planned(write(tmp_path, QWEN3_VL))
    assert got["model"]["hf_params"] == 4_022_468_096
    assert got["model"]["not_counted"] == [second.removeprefix("not counted: ")]


def test_the_headline_says_what_the_total_includes(tmp_path: Path) -> None:
    glm = colocate(
        "plan", "glm-5", "--tp", "8", "--pp", "4", "--ep", "16", "--etp", "1", "--dp", "2", "--pp-layers", "19,20,20,19"
    )
    assert glm.exit_code == 0, glm.output
    assert glm.stdout.startswith(
        "glm-5: 753.87 B params (incl. 1 MTP layer: 10.0 B; vocab padded 154,880 -> 155,648), 42.39 B active; "
        "TP8 x PP4 x DP2, EP16 x ETP1 (expert DP 1); 64 GPUs; mode rematerialize; layer spec te\n"
    )
    dense = colocate("plan", write(tmp_path, QWEN3_4B), "--tp", "2")
    assert dense.stdout.startswith(
        "Qwen3ForCausalLM: 4.02 B params (vocab padded 151,936 -> 152,064); TP2 x PP1 x DP1; 2 GPUs;"
    )
    assert "expert DP" not in dense.stdout and "active" not in dense.stdout
    got = planned("glm-5", "--tp", "8", "--ep", "8", "--etp", "1")
    m = got["model"]
    assert (m["vocab_size"], m["padded_vocab_size"]) == (154880, padded_vocab(154880, 8)) == (154880, 155648)
    assert m["total_params"] - m["mtp_params"] - (155648 - 154880) * 2 * 6144 == m["hf_params"]
    # GLM-5's technical report: 744 B parameters (its checkpoint's, no MTP)
    assert round(m["hf_params"] / 1e9, 1) == 743.9 and round(m["total_params"] / 1e9, 1) == 753.9


def test_a_missing_tie_key_is_the_model_types_default(tmp_path: Path) -> None:
    gemma = {**{k: v for k, v in QWEN3_4B.items() if k != "tie_word_embeddings"}, "model_type": "gemma3_text"}
    tied = planned(write(tmp_path, gemma))["model"]["hf_params"]
    untied = planned(write(tmp_path, {**gemma, "tie_word_embeddings": False}))["model"]["hf_params"]
    assert untied - tied == 151936 * 2560
    unknown = colocate("plan", write(tmp_path, {**gemma, "model_type": "somebody_new"}))
    assert "\nassumed: tie_word_embeddings not given and model_type 'somebody_new' unknown: counted untied" in (
        unknown.stdout
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"hidden_size": "2560"}, ["hidden_size must be an integer, got '2560'"]),
        ({"hidden_size": None}, ["hidden_size is null"]),
        (
            {"mlp_only_layers": 5, "num_experts": 4, "moe_intermediate_size": 8, "num_experts_per_tok": 2},
            ["mlp_only_layers"],
        ),
        (
            {"intermediate_size": -1, "head_dim": -128, "kv_lora_rank": -512, "num_key_value_heads": 0},
            [
                "intermediate_size must be >= 0",
                "head_dim must be >= 1",
                "kv_lora_rank must be >= 0",
                "num_key_value_heads",
            ],
        ),
        ({"num_key_value_heads": 5}, ["num_attention_heads (32) must be a multiple of num_key_value_heads (5)"]),
    ],
    ids=["hidden-string", "hidden-null", "mlp-only-int", "negatives", "kv-5-of-32"],
)
def test_a_bad_config_exits_2_naming_each_key(tmp_path: Path, change: dict[str, Any], says: list[str]) -> None:
    done = colocate("plan", write(tmp_path, {**QWEN3_4B, **change}))
    assert done.exit_code == 2, done.output
    for words in says:
        assert words in done.output
    assert "Traceback" not in done.output


def test_bad_options_exit_2_naming_every_one_at_once() -> None:
    done = colocate(
        "plan", "qwen3-4b", "--engine-gpus", "-1", "--gpu-memory-gb", "-5", "--cuda-graph-gb", "-1", "--pp", "2",
        "--pp-layers", "40,-4",
    )  # fmt: skip
    assert done.exit_code == 2, done.output
    for words in ("--engine-gpus must be >= 0", "--gpu-memory-gb must be > 0", "--cuda-graph-gb must be >= 0"):
        assert words in done.output
    assert "--pp-layers 40,-4: every stage needs >= 1 layer" in done.output
    empty = colocate("plan", "qwen3-4b", "--pp", "2", "--pp-layers", "36,0")
    assert empty.exit_code == 2 and "every stage needs >= 1 layer" in empty.output
    assert "Traceback" not in done.output + empty.output


def test_the_layer_spec_decides_how_mla_down_projections_shard(tmp_path: Path) -> None:
    path = write(tmp_path, SMALL_MLA)
    te, local = (planned(path, "--tp", "2", "--spec", spec) for spec in ("te", "local"))
    assert (te["parallelism"]["layer_spec"], local["parallelism"]["layer_spec"]) == ("te", "local")
    h, layers = 64, 3 + 1  # decoder layers and the MTP layer
    down = 16 * h + (8 + 4) * h  # q down, kv down (+ the rope key)
    assert te["stages"][0]["params"] - local["stages"][0]["params"] == layers * down // 2
    assert te["model"]["total_params"] == local["model"]["total_params"]  # the same model, sharded otherwise
    refused = colocate("plan", "glm-5", "--tp", "8", "--ep", "8", "--spec", "local")
    assert refused.exit_code == 2 and "the DSA indexer: megatron-core builds it only with the TE spec" in refused.output
    odd = colocate("plan", write(tmp_path, {**SMALL_MLA, "q_lora_rank": 18}), "--tp", "4", "--spec", "local")
    assert odd.exit_code == 2 and "the q LoRA rank (18) do not divide by TP" in odd.output


def test_help_lists_the_support_table() -> None:
    done = colocate("plan", "--help")
    assert done.exit_code == 0
    for row in SUPPORT:
        assert row.family.value in done.stdout and row.hf_class in done.stdout
    assert "--spec" in done.stdout


def test_model_shape_refuses_what_the_reader_would() -> None:
    with pytest.raises(Exception, match="32 heads do not split into 5 query groups"):
        ModelShape(
            name="x", hidden_size=64, num_layers=1, vocab_size=8, num_attention_heads=32, num_query_groups=5,
            ffn_hidden_size=8,
        )  # fmt: skip
    assert GLM5["index_n_heads"] == 32  # the preset the refusal above is about is a DSA model


def test_the_checkpoint_rows_say_what_a_save_writes_per_rank_and_in_all() -> None:
    args = ("qwen3-4b", "--tp", "2", "--dp", "2")
    done = colocate("plan", *args)
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in lines if line.count("│") == 3}
    # Qwen3-4B is 4.02 B params: a TP2 shard of them in bf16, a quarter of 12 bytes each (mains + Adam).
    assert rows["model shard (one DP replica)"] == "4.02"
    assert rows["optimizer shard (fp32 state)"] == "12.07"
    assert rows["written (host memory, at most)"] == "16.09"
    assert "checkpoint in all: 56.32 GB (the model once: 8.05 GB; the optimizer state of all 4 ranks: 48.28 GB)" in (
        done.stdout
    )
    got = planned(*args)["checkpoint"]
    (stage,) = got["per_rank"]
    assert (
        got["total"] == got["model"] + got["optimizer"] and got["model"] == 2 * planned(*args)["model"]["total_params"]
    )
    assert stage["written"] == stage["host_for_save"] == stage["model_shard"] + stage["optimizer_shard"]
