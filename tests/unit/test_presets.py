"""Model presets: the CPU default is the job's, the GPU ones have the sizes their names give, and
every one is built from the planner's shape of its name, to the same numbers as before."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest
import torch

from orchestrator.adapters.megatron.convert import hf_llama_config
from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.errors import ConfigError
from orchestrator.job.grpo import GRPOConfig, SyntheticTask
from orchestrator.job.presets import BENCHMARK_MODELS, PRESETS, benchmark_model, grpo_config, param_count, preset
from orchestrator.models import ModelShape
from orchestrator.plan.presets import GPTS

# Each config as it was written out before the planner's specs declared the shapes (2026-12-02).
# fmt: off
TINY = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            vocab_size=10, seq_len=10, num_experts=0, moe_router_topk=1, fp32_param=False, frozen_param=False,
            rotary_base=10000, seed=1234, lr=5e-3, clip_grad=1.0)
QWEN_05B = dict(hidden_size=896, num_layers=24, num_attention_heads=14, num_query_groups=2, ffn_hidden_size=4864,
                vocab_size=65536, seq_len=128, num_experts=0, moe_router_topk=1, fp32_param=False,
                frozen_param=False, rotary_base=1_000_000, seed=1234, lr=3e-4, clip_grad=1.0)
LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=7168,
                vocab_size=32768, seq_len=128, num_experts=0, moe_router_topk=1, fp32_param=False,
                frozen_param=False, rotary_base=500_000, seed=1234, lr=2e-4, clip_grad=1.0)
CPU = dict(hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1536,
           vocab_size=8192, seq_len=32, num_experts=2, moe_router_topk=1, fp32_param=True, frozen_param=True,
           rotary_base=10000, seed=1234, lr=1e-3, clip_grad=1.0)
EXTRAS = dict(num_experts=2, fp32_param=True, frozen_param=True)
BEFORE: dict[str, dict[str, dict[str, Any]]] = {
    "preset": {"tiny": TINY, "qwen-0.5b": QWEN_05B, "llama-1b": LLAMA_1B},
    "benchmark": {"cpu": CPU, "tiny": TINY | EXTRAS, "qwen-0.5b": QWEN_05B | EXTRAS, "llama-1b": LLAMA_1B | EXTRAS},
}
# fmt: on


def test_every_config_built_from_a_planner_spec_is_what_it_was_field_by_field() -> None:
    assert set(BEFORE["preset"]) == set(PRESETS) and set(BEFORE["benchmark"]) == set(BENCHMARK_MODELS)
    assert {name: asdict(preset(name)) for name in PRESETS} == BEFORE["preset"]
    assert {name: asdict(benchmark_model(name)) for name in BENCHMARK_MODELS} == BEFORE["benchmark"]
    assert asdict(GRPOConfig().model) == TINY


def _as_built(name: str, cfg: TinyGPTConfig) -> ModelShape:
    """The planner's shape `name`, with the RoPE and positions the job gives it (its settings)."""
    return replace(GPTS[name], rotary_base=float(cfg.rotary_base), max_position_embeddings=cfg.seq_len)


def test_each_planner_gpt_is_the_shape_of_what_the_job_builds() -> None:
    from benchmarks.plan_vs_measured import _built  # what the planner's byte-for-byte check builds

    assert {name: _built(name).shape(name) for name in GPTS} == {name: _as_built(name, _built(name)) for name in GPTS}
    assert preset("llama-1b").shape("llama-1b") == _as_built("llama-1b", preset("llama-1b"))


def test_a_shape_the_gpt_cannot_be_is_refused_naming_each_field() -> None:
    biased = replace(GPTS["tiny"], qkv_bias=True, moe_layers=(0,), num_experts=2, moe_ffn_hidden_size=128)
    with pytest.raises(ConfigError) as refused:
        TinyGPTConfig.from_shape(biased, seq_len=10)
    assert [str(v).split("=")[0] for v in refused.value.violations] == [
        "tiny: qkv_bias",
        "tiny: moe_layers",
        "tiny: expert_bias",
        "tiny: moe_score_function",
    ]
    assert "tiny: qkv_bias=True, colocate's GPT has False" in refused.value.violations


def test_tiny_is_the_jobs_default_model() -> None:
    assert preset("tiny") == GRPOConfig().model


@pytest.mark.parametrize(("name", "low", "high"), [("qwen-0.5b", 0.4e9, 0.6e9), ("llama-1b", 0.9e9, 1.2e9)])
def test_gpu_presets_have_the_size_their_names_give(name: str, low: float, high: float) -> None:
    assert low < param_count(preset(name)) < high


@pytest.mark.parametrize("name", PRESETS)
def test_param_count_is_what_the_hf_llama_of_the_preset_holds(name: str) -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # shapes only: nothing allocated, nothing downloaded
        model = LlamaForCausalLM(hf_llama_config(preset(name)))
    assert param_count(preset(name)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_runs_the_copy_task_in_its_whole_vocabulary(name: str) -> None:
    grpo = grpo_config(name)  # GRPOConfig validated it: vocabularies equal, sequence long enough
    assert grpo.model == preset(name)
    assert grpo.task.vocab_size == grpo.model.vocab_size
    assert grpo.task.alphabet_size == 8 and grpo.task.length == 4  # the CPU default's task
    assert grpo.model.seq_len >= grpo.max_len


def test_tiny_runs_the_jobs_default_task() -> None:
    assert grpo_config("tiny") == GRPOConfig()


@pytest.mark.parametrize("name", ["qwen-0.5b", "llama-1b"])
def test_gpu_presets_write_symbols_in_their_vocabulary(name: str) -> None:
    grpo = grpo_config(name)
    task = SyntheticTask(grpo.task)
    prompts = task.prompts(256, torch.Generator().manual_seed(0))
    assert int(prompts.max()) < grpo.model.vocab_size and int(prompts.min()) >= 0
    assert (task.symbols(prompts[:, 1:-1]) == prompts[:, 1:-1]).all()  # a prompt's symbol reads as itself
    # Every id but BOS, SEP and fewer than alphabet_size spare ones reads as a symbol.
    read = int((task.symbols(torch.arange(grpo.model.vocab_size)) >= 0).sum())
    assert grpo.model.vocab_size - 2 - grpo.task.alphabet_size < read <= grpo.model.vocab_size - 2


def test_unknown_preset_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'llama-70b'.*tiny"):
        preset("llama-70b")
