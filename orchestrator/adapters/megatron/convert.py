"""Megatron-core GPT → Hugging Face Llama weights, one Megatron tensor at a time.

The trainer's sync yields Megatron names (`decoder.layers.0.self_attention.linear_qkv.weight`); a
Llama engine (transformers here, SGLang later) loads HF names (`model.layers.0.self_attn.q_proj.weight`).
The mapping is the one checked in design §7: with it, Megatron's and HF's logits were
bit-identical in fp32. Tensors are whole, as at tensor- and pipeline-parallel size 1 (a
`vp_stages.i.` prefix has no mapping).

Only what a dense Llama has is mapped. MoE tensors (experts, router, `expert_bias`) and the
test-only `fp32_output_scale` param have no Llama counterpart; `to_hf` refuses them by name
rather than dropping them, since an engine missing them would serve a different policy.

    config = hf_llama_config(cfg)
    hf = [pair for name, tensor in trainer.sync_tensors() for pair in to_hf(name, tensor, cfg)]
    missing = set(hf_names(cfg)) - {name for name, _ in hf}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from orchestrator.adapters.megatron.gpt import TinyGPTConfig

if TYPE_CHECKING:
    from transformers import LlamaConfig

__all__ = ["convert", "hf_llama_config", "hf_names", "hf_shape", "to_hf"]

# TransformerConfig.layernorm_epsilon's default; HF's LlamaConfig defaults to 1e-6.
MEGATRON_LAYERNORM_EPS = 1e-5

# Neither attention is bit-exact against Megatron's bf16 forward (design §7's bit-identity was in
# fp32). On CPU, sdpa came out slightly closer (mean abs logit difference 0.0069 vs 0.0070, max
# 0.04-0.05 vs 0.04-0.06, logits of mean magnitude 0.8) and is faster, so the engine uses it.
ATTN_IMPLEMENTATION = "sdpa"


def _head_dim(cfg: TinyGPTConfig) -> int:
    return cfg.hidden_size // cfg.num_attention_heads


def _require_dense(cfg: TinyGPTConfig) -> None:
    problems = []
    if cfg.num_experts > 0:
        problems.append(f"num_experts={cfg.num_experts} (the engine side is dense Llama only)")
    if cfg.hidden_size % cfg.num_attention_heads:
        problems.append(f"hidden_size {cfg.hidden_size} is not a multiple of {cfg.num_attention_heads} heads")
    if cfg.num_attention_heads % cfg.num_query_groups:
        problems.append(f"{cfg.num_attention_heads} heads do not split into {cfg.num_query_groups} query groups")
    if problems:
        raise ValueError("no Llama equivalent: " + "; ".join(problems))


def hf_llama_config(cfg: TinyGPTConfig) -> LlamaConfig:
    """The `LlamaConfig` that computes what Megatron's GPT computes, in bf16."""
    from transformers import LlamaConfig

    _require_dense(cfg)
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=_head_dim(cfg),
        hidden_act="silu",
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=MEGATRON_LAYERNORM_EPS,
        # transformers 5.x moved the theta into `rope_parameters`; Megatron's default RoPE is
        # the non-interleaved (rotate-half) one, which is HF's "default".
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        dtype=torch.bfloat16,
        # Taken through the config's **kwargs, which transformers 5's dataclass signature hides.
        attn_implementation=ATTN_IMPLEMENTATION,  # type: ignore[call-arg]
    )


# ---- per-tensor mapping ---------------------------------------------------------------------

Split = Callable[[torch.Tensor, TinyGPTConfig], list[torch.Tensor]]


def _split_qkv(tensor: torch.Tensor, cfg: TinyGPTConfig) -> list[torch.Tensor]:
    """Megatron interleaves per query group: [q of nh/ng heads, k, v] for each group in turn."""
    groups, head_dim = cfg.num_query_groups, _head_dim(cfg)
    heads_per_group = cfg.num_attention_heads // groups
    grouped = tensor.view(groups, (heads_per_group + 2) * head_dim, cfg.hidden_size)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [part.reshape(-1, cfg.hidden_size) for part in (q, k, v)]


def _split_fc1(tensor: torch.Tensor, cfg: TinyGPTConfig) -> list[torch.Tensor]:
    """SwiGLU's fc1 is cat([gate, up]) along the output rows."""
    gate, up = tensor.chunk(2, dim=0)
    return [gate, up]


def _same(tensor: torch.Tensor, cfg: TinyGPTConfig) -> list[torch.Tensor]:
    return [tensor]


_LAYER = r"decoder\.layers\.(?P<i>\d+)\."

# (Megatron name pattern, HF names with {i} for the layer, how to split). The TE-spec names
# (norm fused into the next linear as `layer_norm_weight`) map to the same HF norms.
_RULES: tuple[tuple[re.Pattern[str], tuple[str, ...], Split], ...] = tuple(
    (re.compile(pattern + r"$"), targets, split)
    for pattern, targets, split in (
        (r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), _same),
        (_LAYER + r"input_layernorm\.weight", ("model.layers.{i}.input_layernorm.weight",), _same),
        (
            _LAYER + r"self_attention\.linear_qkv\.layer_norm_weight",
            ("model.layers.{i}.input_layernorm.weight",),
            _same,
        ),
        (
            _LAYER + r"self_attention\.linear_qkv\.weight",
            tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
            _split_qkv,
        ),
        (_LAYER + r"self_attention\.linear_proj\.weight", ("model.layers.{i}.self_attn.o_proj.weight",), _same),
        (_LAYER + r"pre_mlp_layernorm\.weight", ("model.layers.{i}.post_attention_layernorm.weight",), _same),
        (_LAYER + r"mlp\.linear_fc1\.layer_norm_weight", ("model.layers.{i}.post_attention_layernorm.weight",), _same),
        (
            _LAYER + r"mlp\.linear_fc1\.weight",
            ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
            _split_fc1,
        ),
        (_LAYER + r"mlp\.linear_fc2\.weight", ("model.layers.{i}.mlp.down_proj.weight",), _same),
        (r"decoder\.final_layernorm\.weight", ("model.norm.weight",), _same),
        (r"output_layer\.weight", ("lm_head.weight",), _same),
    )
)

# Known Megatron tensors with no dense-Llama counterpart, and why.
_REFUSED: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.mlp\.(experts|router)\.|expert_bias$"), "MoE tensors have no dense Llama counterpart"),
    (re.compile(r"(^|\.)fp32_output_scale$"), "fp32_output_scale is a test-only param with no Llama counterpart"),
)


def _expected_shapes(cfg: TinyGPTConfig) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = cfg.hidden_size, _head_dim(cfg)
    return {
        "embed_tokens": (cfg.vocab_size, hidden),
        "lm_head": (cfg.vocab_size, hidden),
        "layernorm": (hidden,),
        "norm": (hidden,),
        "q_proj": (cfg.num_attention_heads * head_dim, hidden),
        "k_proj": (cfg.num_query_groups * head_dim, hidden),
        "v_proj": (cfg.num_query_groups * head_dim, hidden),
        "o_proj": (hidden, cfg.num_attention_heads * head_dim),
        "gate_proj": (cfg.ffn_hidden_size, hidden),
        "up_proj": (cfg.ffn_hidden_size, hidden),
        "down_proj": (hidden, cfg.ffn_hidden_size),
    }


def hf_shape(hf_name: str, cfg: TinyGPTConfig) -> tuple[int, ...]:
    """The shape an HF Llama built from `hf_llama_config(cfg)` gives `hf_name`."""
    module = hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
    return _expected_shapes(cfg)["layernorm" if module.endswith("layernorm") else module]


def _expected_source_shape(targets: tuple[str, ...], cfg: TinyGPTConfig) -> tuple[int, ...]:
    """The Megatron tensor is its HF parts stacked along the rows (or one of them as is)."""
    shapes = [hf_shape(t, cfg) for t in targets]
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def to_hf(name: str, tensor: torch.Tensor, cfg: TinyGPTConfig) -> list[tuple[str, torch.Tensor]]:
    """The HF Llama tensors one Megatron tensor becomes: views of `tensor` where the split allows.

    Raises ValueError, naming the tensor, for MoE tensors (experts, router, expert_bias), the
    test-only `fp32_output_scale`, any name the mapping does not know, a layer index beyond
    `cfg.num_layers`, and a shape that does not match `cfg`.
    """
    for pattern, why in _REFUSED:
        if pattern.search(name):
            raise ValueError(f"cannot convert {name!r} to HF Llama: {why}")
    for pattern, targets, split in _RULES:
        match = pattern.match(name)
        if match is None:
            continue
        layer = match.groupdict().get("i")
        if layer is not None and int(layer) >= cfg.num_layers:
            raise ValueError(f"cannot convert {name!r}: layer {layer} is beyond num_layers={cfg.num_layers}")
        expected = _expected_source_shape(targets, cfg)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"cannot convert {name!r}: shape {tuple(tensor.shape)}, expected {expected} for this config"
            )
        hf = [t.format(i=layer) for t in targets]
        return list(zip(hf, split(tensor, cfg), strict=True))
    raise ValueError(f"cannot convert {name!r} to HF Llama: no mapping for this Megatron name")


def convert(named: Iterable[tuple[str, torch.Tensor]], cfg: TinyGPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_hf` over a whole sync, lazily: the first unmappable tensor raises."""
    for name, tensor in named:
        yield from to_hf(name, tensor, cfg)


def hf_names(cfg: TinyGPTConfig) -> list[str]:
    """Every HF name a complete sync of `cfg` produces, in `LlamaForCausalLM.named_parameters` order."""
    per_layer = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
    layers = [f"model.layers.{i}.{module}.weight" for i in range(cfg.num_layers) for module in per_layer]
    return ["model.embed_tokens.weight", *layers, "model.norm.weight", "lm_head.weight"]
