"""Model presets by name: the CPU default and two GPU-size Llama/Qwen-shaped GPTs.

Every preset is a `TinyGPTConfig`: `megatron_build.build_gpt` builds it with random init (nothing
is downloaded), and `convert.hf_llama_config` gives the Hugging Face Llama an engine serves. Its
shape is the planner's `ModelShape` of the same name (`orchestrator.plan.presets.GPTS`); what a
shape does not give it (sequence length, learning rate, RoPE base) is set here.

- `tiny`: the job's default, `GRPOConfig().model` (about 0.1 M params; learns the copy task on CPU).
- `qwen-0.5b`: Qwen2.5-0.5B's blocks (hidden 896, 24 layers, 14 heads in 2 KV groups, SwiGLU 4864)
  with a 64 K vocabulary and an untied output layer: about 0.48 B params.
- `llama-1b`: Llama-3.2-1B's width and depth (hidden 2048, 16 layers, 8 KV groups) with 16 heads of
  128, SwiGLU 7168 and a 32 K vocabulary, untied: about 1.0 B params. The restore and weight-sync
  goals are stated at this size.

The GPU presets' sequence length (128) holds the copy task's prompt and completion; their learning
rates are the usual ones for the size, not tuned on the copy task. `grpo_config` writes the task
in the preset's whole vocabulary (`grpo.TaskConfig`): the engine samples from all of it, and with
the 8 symbols as 8 ids only, a random policy's completion token was a symbol once in thousands.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.adapters.megatron.gpt import GPTConfig, TinyGPTConfig
from orchestrator.errors import ConfigError
from orchestrator.plan.presets import GPTS, PUBLISHED_MODELS, with_extras

if TYPE_CHECKING:
    from orchestrator.job.grpo import GRPOConfig

__all__ = ["BENCHMARK_MODELS", "PRESETS", "benchmark_model", "grpo_config", "param_count", "preset"]


def _tiny() -> TinyGPTConfig:
    from orchestrator.job.grpo import GRPOConfig

    model = GRPOConfig().model
    assert isinstance(model, TinyGPTConfig)  # the job's default
    return model


_GPU: dict[str, TinyGPTConfig] = {
    "qwen-0.5b": TinyGPTConfig.from_shape(GPTS["qwen-0.5b"], seq_len=128, rotary_base=1_000_000, lr=3e-4),
    "llama-1b": TinyGPTConfig.from_shape(GPTS["llama-1b"], seq_len=128, rotary_base=500_000, lr=2e-4),
}

PRESETS: tuple[str, ...] = ("tiny", *_GPU)


def preset(name: str) -> TinyGPTConfig:
    """The config named `name`; ValueError naming the known presets otherwise."""
    if name == "tiny":
        return _tiny()
    if name not in _GPU:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return _GPU[name]


def grpo_config(name: str, *, layers: int | None = None, experts: int | None = None) -> GRPOConfig:
    """What `colocate run --model NAME` trains: a preset's model, or a family model (a built-in
    name or a config.json, `models.family_model`, shrunk to `layers` and `experts`); and the copy
    task written in its whole vocabulary (`grpo.TaskConfig`), since the policy samples from all of it.
    ConfigError naming the problem otherwise."""
    from orchestrator.job.grpo import GRPOConfig, TaskConfig
    from orchestrator.job.models import FAMILY_MODELS, family_model

    model: TinyGPTConfig | GPTConfig
    if name in PRESETS:
        if layers is not None or experts is not None:
            raise ConfigError([f"--layers and --experts shrink a family model; preset {name} is fixed"])
        model = preset(name)
    elif name in PUBLISHED_MODELS or Path(name).exists():
        model = family_model(name, layers=layers, experts=experts)
    else:
        raise ConfigError(
            [
                f"{name}: no such config.json, and not a preset ({', '.join(PRESETS)}) or a seed workload "
                f"({', '.join(FAMILY_MODELS)})"
            ]
        )
    return GRPOConfig(model=model, task=TaskConfig(vocab_size=model.vocab_size))


BENCHMARK_MODELS: tuple[str, ...] = ("cpu", *PRESETS)


def benchmark_model(name: str) -> TinyGPTConfig:
    """`cpu` (the planner's, extras and all) or a preset, with every kind of extra a restore must
    handle (`plan.presets.with_extras`): an MoE last layer (expert_bias), an fp32 param and a
    frozen param."""
    if name == "cpu":
        return TinyGPTConfig.from_shape(GPTS["cpu"])
    return TinyGPTConfig.from_shape(with_extras(GPTS[name]), **preset(name).settings())


def param_count(cfg: TinyGPTConfig) -> int:
    """Params of the Megatron GPT `build_gpt(cfg)` makes, counted from the shape alone.

    Dense layers: QKV, output projection, SwiGLU fc1 (gate and up) and fc2, two RMSNorm weights.
    An MoE last layer (`num_experts > 0`) has `num_experts` SwiGLU MLPs and a router instead.
    Plus the input embedding, the untied output layer and the final norm (and `fp32_param`'s scale).
    """
    hidden, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    head_dim = hidden // cfg.num_attention_heads
    attention = hidden * (cfg.num_attention_heads + 2 * cfg.num_query_groups) * head_dim + hidden * hidden
    mlp = 3 * hidden * ffn
    dense = attention + mlp + 2 * hidden
    layers = cfg.num_layers * dense
    if cfg.num_experts > 0:
        layers += cfg.num_experts * mlp - mlp + cfg.num_experts * hidden
    outer = 2 * cfg.vocab_size * hidden + hidden + (hidden if cfg.fp32_param else 0)
    return layers + outer
