"""Model presets by name: the CPU default and two GPU-size Llama/Qwen-shaped GPTs.

Every preset is a `TinyGPTConfig`: `megatron_build.build_gpt` builds it with random init (nothing
is downloaded), and `convert.hf_llama_config` gives the Hugging Face Llama an engine serves.

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

from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.adapters.megatron.gpt import TinyGPTConfig

if TYPE_CHECKING:
    from orchestrator.job.grpo import GRPOConfig

__all__ = ["BENCHMARK_MODELS", "PRESETS", "benchmark_model", "grpo_config", "param_count", "preset"]


def _tiny() -> TinyGPTConfig:
    from orchestrator.job.grpo import GRPOConfig

    return GRPOConfig().model


_GPU: dict[str, TinyGPTConfig] = {
    "qwen-0.5b": TinyGPTConfig(hidden_size=896, num_layers=24, num_attention_heads=14, num_query_groups=2,
                               ffn_hidden_size=4864, vocab_size=65536, seq_len=128, rotary_base=1_000_000, lr=3e-4),
    "llama-1b": TinyGPTConfig(hidden_size=2048, num_layers=16, num_attention_heads=16, num_query_groups=8,
                              ffn_hidden_size=7168, vocab_size=32768, seq_len=128, rotary_base=500_000, lr=2e-4),
}  # fmt: skip

PRESETS: tuple[str, ...] = ("tiny", *_GPU)


def preset(name: str) -> TinyGPTConfig:
    """The config named `name`; ValueError naming the known presets otherwise."""
    if name == "tiny":
        return _tiny()
    if name not in _GPU:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return _GPU[name]


def grpo_config(name: str) -> GRPOConfig:
    """What `colocate run --model NAME` trains: the preset's model, and the copy task written in
    its whole vocabulary (`grpo.TaskConfig`), since the policy samples from all of it."""
    from orchestrator.job.grpo import GRPOConfig, TaskConfig

    model = preset(name)
    return GRPOConfig(model=model, task=TaskConfig(vocab_size=model.vocab_size))


# The CPU-size model of the restore benchmark and the planner's byte-for-byte check.
_CPU = TinyGPTConfig(hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=1536, vocab_size=8192)  # fmt: skip
BENCHMARK_MODELS: tuple[str, ...] = ("cpu", *PRESETS)


def benchmark_model(name: str) -> TinyGPTConfig:
    """`cpu` or a preset, with every kind of extra a restore must handle: an MoE last layer
    (expert_bias), an fp32 param and a frozen param."""
    base = _CPU if name == "cpu" else preset(name)
    return replace(base, num_experts=2, fp32_param=True, frozen_param=True)


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
