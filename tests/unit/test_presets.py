"""Model presets: the CPU default is the job's, the GPU ones have the sizes their names give."""

from __future__ import annotations

import pytest
import torch

from orchestrator.adapters.megatron.convert import hf_llama_config
from orchestrator.job.grpo import GRPOConfig, SyntheticTask
from orchestrator.job.presets import PRESETS, grpo_config, param_count, preset


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
