"""The trainer `colocate check` judges the engine and the conversion against: the model `colocate
run --model NAME` trains (`presets.grpo_config`), for the name or config.json the check was given.

Its imports are made when a check asks, never when `colocate check` is imported (the CLI stays
light); `job_model` is cached, since both groups ask for the same model.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from orchestrator.errors import ConfigError

if TYPE_CHECKING:
    from orchestrator.adapters.megatron.gpt import GPTConfig, TinyGPTConfig
    from orchestrator.models import ModelShape


_BENCHMARKS = {"cpu": "cpu", "gpu-1b": "llama-1b"}


@functools.cache
def job_model(name: str) -> TinyGPTConfig | GPTConfig:
    """What `colocate run --model name` builds (the benchmark models `cpu` and `gpu-1b` too, with
    their extras); ConfigError naming the problem otherwise."""
    from orchestrator.job.presets import benchmark_model, grpo_config

    if name in _BENCHMARKS:  # the planner's names for the restore benchmark's models
        return benchmark_model(_BENCHMARKS[name])
    try:
        return grpo_config(name).model
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None


def served_shape(model: TinyGPTConfig | GPTConfig) -> ModelShape:
    """The model the job has its engine serve, as the converter compares it (`served_problems`):
    a family model's own config, read by the planner's reader; colocate's GPT's shape, whose HF
    config `colocate engine-config` writes."""
    from orchestrator.adapters.megatron.gpt import GPTConfig
    from orchestrator.models import read_config

    if isinstance(model, GPTConfig):
        return read_config(model.served, source="the config the job serves")
    return model.shape()


def served_config(model: TinyGPTConfig | GPTConfig) -> dict[str, Any]:
    """The HF config the engine builds its model from: a family model's own, or the Llama config
    `colocate engine-config` writes for colocate's GPT."""
    from orchestrator.adapters.megatron.gpt import GPTConfig

    if isinstance(model, GPTConfig):
        return dict(model.served)
    from orchestrator.adapters.megatron.convert import hf_llama_config

    return dict(hf_llama_config(model).to_dict())
