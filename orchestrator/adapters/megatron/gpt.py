"""The embedded default model's shape: a small Llama-shaped GPT, described without megatron-core.

`megatron_build.build_gpt` turns it into a Megatron-core model; `convert.hf_llama_config` into
the matching Hugging Face Llama. Its shape comes from a planner `ModelSpec` (`from_spec`: colocate's
own GPTs are declared in orchestrator/plan/presets.py), its run settings from the job.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.plan.model import ModelSpec
from orchestrator.plan.presets import FROZEN_PARAM

# What a planner spec does not hold: how the job trains the model, not its shape.
SETTINGS = ("seq_len", "rotary_base", "seed", "lr", "clip_grad")


@dataclass(frozen=True, kw_only=True)
class TinyGPTConfig:
    """A Llama-shaped GPT: RMSNorm, SwiGLU, RoPE, GQA, no linear bias, untied output layer."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 128
    seq_len: int = 32
    num_experts: int = 0  # 0: dense; > 0: the last layer is MoE, with expert_bias
    moe_router_topk: int = 1
    fp32_param: bool = False  # one fp32-dtype param (its DDP buffer is its own)
    frozen_param: bool = False  # decoder.layers.0.input_layernorm.weight gets requires_grad=False
    rotary_base: int = 10000
    seed: int = 1234
    lr: float = 1e-3
    clip_grad: float = 1.0

    @classmethod
    def from_spec(cls, spec: ModelSpec, **settings: Any) -> TinyGPTConfig:
        """The config whose GPT is `spec`, trained with `settings` (of SETTINGS; the defaults for
        the rest). A spec this GPT cannot be (a bias, a q/k norm, MLA, experts on any layer but the
        last, ...) is a ConfigError naming each field that differs from what it builds."""
        cfg = cls(
            hidden_size=spec.hidden_size,
            num_layers=spec.num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
            ffn_hidden_size=spec.ffn_hidden_size,
            vocab_size=spec.vocab_size,
            num_experts=spec.num_experts,
            moe_router_topk=spec.moe_router_topk,
            fp32_param=spec.fp32_param_numel > 0,
            frozen_param=bool(spec.frozen),
            **settings,
        )
        built = cfg.spec(spec.name)
        differ = [f.name for f in fields(spec) if getattr(spec, f.name) != getattr(built, f.name)]
        if differ:
            raise ConfigError(
                [f"{spec.name}: {k}={getattr(spec, k)!r}, colocate's GPT has {getattr(built, k)!r}" for k in differ]
            )
        return cfg

    def spec(self, name: str) -> ModelSpec:
        """The planner's spec of the GPT `build_gpt` makes of this config: its last layer is MoE
        when it has experts."""
        moe = self.num_experts > 0
        return ModelSpec(
            name=name,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            vocab_size=self.vocab_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            moe_layers=(False,) * (self.num_layers - 1) + (moe,),
            num_experts=self.num_experts,
            moe_ffn_hidden_size=self.ffn_hidden_size if moe else 0,
            moe_router_topk=self.moe_router_topk,
            expert_bias=moe,
            fp32_param_numel=self.hidden_size if self.fp32_param else 0,
            frozen=(FROZEN_PARAM,) if self.frozen_param else (),
        )

    def settings(self) -> dict[str, Any]:
        """How the job trains this model (SETTINGS), for a config of another shape."""
        return {name: getattr(self, name) for name in SETTINGS}
