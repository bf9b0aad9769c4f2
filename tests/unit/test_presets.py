"""Model presets: the CPU default is the job's, the GPU ones have the sizes their names give."""

from __future__ import annotations

import pytest
import torch

from orchestrator.adapters.megatron.convert import hf_llama_config
from orchestrator.demo.grpo import GRPOConfig
from orchestrator.demo.presets import PRESETS, param_count, preset


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


def test_gpu_presets_hold_the_copy_task() -> None:
    task = GRPOConfig().task
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.vocab_size >= task.vocab_size
        assert cfg.seq_len >= task.prompt_len + task.length


def test_unknown_preset_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'llama-70b'.*tiny"):
        preset("llama-70b")
