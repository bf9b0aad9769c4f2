"""The configs of the GPTs colocate builds, described without megatron-core.

- `TinyGPTConfig`: colocate's own Llama-shaped GPT (the job's default and presets, and the
  benchmarks' models with every kind of extra a restore must handle).
- `GPTConfig`: a GPT of any family colocate converts (`orchestrator.models.SUPPORT`), as a
  published or user's HF `config.json` describes it, perhaps with fewer layers and experts.

`megatron_build.build_gpt` turns it into a Megatron-core model; `convert.hf_llama_config` into
the matching Hugging Face Llama. Its shape comes from a `ModelShape` (`from_shape`: colocate's own
GPTs are declared in orchestrator/plan/presets.py), its run settings from the job; `shape()` is
the one way back, the shape it builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.models import Family, ModelShape
from orchestrator.plan.presets import FROZEN_PARAM

# What a shape does not give this config: how the job trains the model, not its shape.
SETTINGS = ("seq_len", "rotary_base", "seed", "lr", "clip_grad")
# The fields this config and a shape both have, meaning the same.
_SAME: tuple[str, ...] = (
    "hidden_size",
    "num_layers",
    "vocab_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
)
_SAME += ("num_experts",)
# What `from_shape` takes of a shape as it is (`_TAKEN`), and what only names the shape or is the
# job's setting (`_FREE`): every other field must be what this GPT builds (`_builds`).
_TAKEN = (*_SAME, "moe_router_topk")
_FREE: tuple[str, ...] = (
    "name",
    "family",
    "source",
    "model_type",
    "text_model_type",
    "architectures",
    "not_counted",
    "assumed",
)
_FREE += ("rotary_base", "max_position_embeddings")


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
    def from_shape(cls, shape: ModelShape, **settings: Any) -> TinyGPTConfig:
        """The config whose GPT is `shape`, trained with `settings` (of SETTINGS; the defaults for
        the rest). A shape this GPT cannot be (a bias, a q/k norm, MLA, experts on any layer but the
        last, ...) is a ConfigError naming each field that differs from what it builds."""
        problems = [
            f"{shape.name}: {k}={getattr(shape, k)!r}, colocate's GPT has {' or '.join(map(repr, built))}"
            for k, built in _builds(shape).items()
            if getattr(shape, k) not in built
        ]
        if problems:
            raise ConfigError(problems)
        return cls(
            **{k: getattr(shape, k) for k in _SAME},
            moe_router_topk=shape.moe_router_topk or 1,
            fp32_param=shape.fp32_param_numel > 0,
            frozen_param=bool(shape.frozen),
            **settings,
        )

    def shape(self, name: str = "", family: Family = Family.LLAMA) -> ModelShape:
        """The shape of the GPT `build_gpt` makes of this config: its last layer is MoE when it has
        experts (sigmoid-routed, with expert_bias)."""
        moe = self.num_experts > 0
        return ModelShape(
            name=name,
            family=family,
            **{k: getattr(self, k) for k in _SAME},
            max_position_embeddings=self.seq_len,
            rotary_base=float(self.rotary_base),
            moe_layers=(self.num_layers - 1,) if moe else (),
            moe_ffn_hidden_size=self.ffn_hidden_size if moe else 0,
            moe_router_topk=self.moe_router_topk if moe else 0,
            expert_bias=moe,
            moe_score_function="sigmoid" if moe else "softmax",
            fp32_param_numel=self.hidden_size if self.fp32_param else 0,
            frozen=(FROZEN_PARAM,) if self.frozen_param else (),
        )

    def settings(self) -> dict[str, Any]:
        """How the job trains this model (SETTINGS), for a config of another shape."""
        return {name: getattr(self, name) for name in SETTINGS}


def _builds(shape: ModelShape) -> dict[str, tuple[Any, ...]]:
    """For each field `from_shape` does not take (`_TAKEN`, `_FREE`), the values this GPT can build
    given the ones it takes: a dense MLP everywhere but an MoE last layer, and none of the
    features beyond Llama (each at its default)."""
    moe = shape.num_experts > 0
    builds: dict[str, tuple[Any, ...]] = {
        f.name: (f.default,) for f in fields(ModelShape) if f.name not in _TAKEN + _FREE
    }
    return builds | {
        "head_dim": (0, shape.hidden_size // shape.num_attention_heads),
        "moe_layers": ((shape.num_layers - 1,),) if moe else ((),),
        "moe_ffn_hidden_size": (shape.ffn_hidden_size if moe else 0,),
        "expert_bias": (moe,),
        "moe_score_function": ("sigmoid",) if moe else ("softmax",),
        "fp32_param_numel": (0, shape.hidden_size),
        "frozen": ((), (FROZEN_PARAM,)),
    }


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A GPT of any family colocate converts, as the job trains it.

    `model` is its shape, read from `served` (`orchestrator.models.read_config`): the HF config the
    engine builds its own transformers class from, and the one the trainer's model is checked
    against (`served_config`). `shrunk` says what was made smaller than the source's, one phrase
    each ("3 of 78 layers"). `init_method_std` is the HF config's `initializer_range`.
    """

    model: ModelShape
    served: Mapping[str, Any]
    shrunk: tuple[str, ...] = ()
    seq_len: int = 128
    seed: int = 1234
    lr: float = 1e-4
    clip_grad: float = 1.0
    init_method_std: float = 0.02

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def rotary_base(self) -> float:
        return self.model.rotary_base

    def shape(self, name: str = "", family: Family | None = None) -> ModelShape:
        """The shape the builder builds (`name` and `family` are `TinyGPTConfig.shape`'s; this one
        knows its own)."""
        return self.model

    def settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("seq_len", "seed", "lr", "clip_grad")}
