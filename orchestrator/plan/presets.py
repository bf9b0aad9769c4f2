"""Models the planner knows by name: colocate's own GPTs, and published ones.

colocate's GPTs are declared here, once, as plain numbers: orchestrator/job/presets.py builds each
as the `TinyGPTConfig` it trains, adding what a shape does not hold (sequence length, learning
rate, RoPE base). The published ones are their `config.json` files, kept as package data in
orchestrator/models/published/ (its README says where each came from), so planning never
downloads anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.models import Family, ModelShape
from orchestrator.plan.model import from_config, from_hf_config

# The param colocate's GPT builds with requires_grad=False when it is asked for a frozen one.
FROZEN_PARAM = "decoder.layers.0.input_layernorm.weight"


def with_extras(shape: ModelShape, name: str | None = None) -> ModelShape:
    """`shape` with every kind of extra a restore must handle, as colocate's GPT builds them: its
    last layer MoE (2 experts of its dense width, with expert_bias), an fp32 param (a vector of
    `hidden_size`) and a frozen param (`FROZEN_PARAM`)."""
    return replace(
        shape,
        name=name or shape.name,
        moe_layers=(shape.num_layers - 1,),
        num_experts=2,
        moe_ffn_hidden_size=shape.ffn_hidden_size,
        moe_router_topk=1,
        expert_bias=True,
        moe_score_function="sigmoid",  # Megatron refuses softmax scores with expert_bias
        fp32_param_numel=shape.hidden_size,
        frozen=(FROZEN_PARAM,),
    )


# What `colocate run --model` trains (orchestrator/job/presets.py says what each is). `tiny`'s
# vocabulary is its copy task's (8 symbols, BOS and SEP); a hidden size of 128 learned it no faster
# per step: the batch size, not the width, limits that task.
_LLAMA = Family.LLAMA  # colocate's GPT converts to HF's Llama
_TRAINED = (
    ModelShape(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
               ffn_hidden_size=128, vocab_size=10, family=_LLAMA),
    ModelShape(name="qwen-0.5b", hidden_size=896, num_layers=24, num_attention_heads=14, num_query_groups=2,
               ffn_hidden_size=4864, vocab_size=65536, family=_LLAMA),
    ModelShape(name="llama-1b", hidden_size=2048, num_layers=16, num_attention_heads=16, num_query_groups=8,
               ffn_hidden_size=7168, vocab_size=32768, family=_LLAMA),
)  # fmt: skip
# The restore benchmark's models, extras included: `cpu`, the size the planner's byte-for-byte
# check builds (tests/integration/test_plan_vs_megatron.py), and `gpu-1b`, its `llama-1b`.
_CPU = ModelShape(name="cpu", hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=1536, vocab_size=8192, family=_LLAMA)  # fmt: skip
GPTS: dict[str, ModelShape] = {shape.name: shape for shape in _TRAINED} | {
    "cpu": with_extras(_CPU),
    "gpu-1b": with_extras(_TRAINED[2], "gpu-1b"),
}


_PUBLISHED_DIR = Path(__file__).resolve().parent.parent / "models" / "published"
# name -> the published model it is (orchestrator/models/published/README.md says where each
# config.json came from)
PUBLISHED_MODELS = {
    "qwen3-4b": "Qwen/Qwen3-4B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "glm-4.5": "zai-org/GLM-4.5",
    "glm-5": "zai-org/GLM-5",
}


def published_config(name: str) -> dict[str, Any]:
    """The published `config.json` of the model `name` (a key of `PUBLISHED_MODELS`), as a fresh dict."""
    if name not in PUBLISHED_MODELS:
        raise ConfigError([f"no published config {name!r} (there are: {', '.join(PUBLISHED_MODELS)})"])
    config: dict[str, Any] = json.loads((_PUBLISHED_DIR / f"{name}.json").read_text())
    return config


def _published(name: str) -> Callable[[], ModelShape]:
    return lambda: from_config(published_config(name), source=f"preset {name}", name=name)


PUBLISHED: dict[str, Callable[[], ModelShape]] = {name: _published(name) for name in PUBLISHED_MODELS}
# The two the planner's tests read most, by their old names.
QWEN3_4B = published_config("qwen3-4b")
GLM5 = published_config("glm-5")
PRESETS: tuple[str, ...] = (*GPTS, *PUBLISHED)


def load_model(source: str | Path) -> ModelShape:
    """A preset's name, or the path of an HF `config.json` (or of the folder that holds one)."""
    if isinstance(source, str) and source in GPTS:
        return GPTS[source]
    if isinstance(source, str) and source in PUBLISHED:
        return PUBLISHED[source]()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError([f"model {source!r}: no such file, and not a preset (presets: {', '.join(sorted(PRESETS))})"])
    return from_hf_config(path)
