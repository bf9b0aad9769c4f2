"""What a conversion needs to know about a model: its `ModelShape`, read from Megatron's configs,
and what the HF family it converts to cannot compute.

`shape_from_megatron(config, gpt)` reads a `TransformerConfig` and the `GPTModel` built from it
(vocab, RoPE base, tied embeddings live on the model, not the config). `checked(shape)` is the
converter's door: every function that takes a shape (`hf_config`, `to_hf`, `hf_names`, ...) goes
through it, the job's `TinyGPTConfig` as `cfg.shape()`.

Only what the HF family can compute the same way is accepted: anything else is refused, before a
rank starts a collective, with every problem named at once. The family modules (`mla`, `routed`,
`glm`, `dsa`, `mtp`) each name their own; the checks here call them, so they sit above them.
"""

from __future__ import annotations

from typing import Any

from orchestrator.adapters.megatron.convert import dsa, glm, mla, mtp, routed
from orchestrator.models import MEGATRON_LAYERNORM_EPS, Family, ModelShape, support_table

__all__ = [
    "MEGATRON_LAYERNORM_EPS",
    "Family",
    "ModelSpec",
    "checked",
    "family_of",
    "megatron_shape",
    "refusals",
    "shape_from_megatron",
]


def family_of(config: Any) -> Family:
    """The family a `TransformerConfig` reads as: DSA makes it GLM-5, MLA DeepSeek-V3, sigmoid-routed
    experts GLM-4.5, other experts Qwen3-MoE with a q/k norm and Mixtral without; a dense model is
    Qwen3 with a q/k norm and Llama without. A model the family cannot compute is refused by
    `shape_from_megatron`."""
    if getattr(config, "experimental_attention_variant", None) == "dsa":
        return Family.GLM_MOE_DSA
    if getattr(config, "multi_latent_attention", False):
        return Family.DEEPSEEK_V3
    if config.num_moe_experts and config.moe_router_score_function == "sigmoid":
        return Family.GLM4_MOE
    if config.num_moe_experts:
        return Family.QWEN3_MOE if config.qk_layernorm else Family.MIXTRAL
    return Family.QWEN3 if config.qk_layernorm else Family.LLAMA


def checked(shape: ModelShape) -> ModelShape:
    """`shape`, when its HF family computes what it says; ValueError naming every problem otherwise."""
    problems = refusals(shape)
    if problems:
        family = shape.family.value if shape.family else "family"
        raise ValueError(f"no HF {family} equivalent: " + "; ".join(problems))
    return shape


def refusals(shape: ModelShape) -> list[str]:
    """Why HF's `shape.family` would compute otherwise than `shape` says: the base checks here and
    each family module's `spec_problems`."""
    if shape.family is None:
        return [f"no family (colocate converts to\n{support_table()})"]
    out = []
    if shape.family is Family.LLAMA and shape.qk_layernorm:
        out.append("qk_layernorm (Llama has no q/k norm: use the qwen3 family)")
    if shape.family in (Family.LLAMA, Family.QWEN3) and shape.num_experts:
        moe = "qwen3_moe" if shape.qk_layernorm else "mixtral"
        out.append(f"num_experts={shape.num_experts} (the {shape.family.value} family is dense: use {moe})")
    if shape.family is Family.QWEN3 and not shape.qk_layernorm:
        out.append("no qk_layernorm (Qwen3 normalises q and k: use the llama family)")
    if shape.family is Family.QWEN3_MOE:
        if not shape.num_experts or not shape.moe_layers:
            out.append("no MoE layer (use the qwen3 family)")
        if not shape.qk_layernorm:
            out.append("no qk_layernorm (Qwen3-MoE normalises q and k)")
        if shape.expert_bias:
            # Megatron's expert_bias needs sigmoid scores; Qwen3-MoE routes by softmax with
            # no bias, so an engine would pick other experts than the trainer did.
            out.append("moe_router_enable_expert_bias (Qwen3-MoE's router has no expert bias)")
    if shape.family is Family.MIXTRAL:
        out += _mixtral_problems(shape)
    out += [f"{what} (the converter writes no such model)" for what, used in _unwritten(shape) if used]
    for what, used, families in _features(shape):
        if used and shape.family not in families:
            others = ", ".join(sorted(f.value for f in families))
            out.append(f"{what} (HF {shape.family.value} has no counterpart; {others} do)")
    specific = mla.spec_problems(shape) + routed.spec_problems(shape) + glm.spec_problems(shape)
    return out + specific + dsa.spec_problems(shape) + mtp.spec_problems(shape)


def _mixtral_problems(shape: ModelShape) -> list[str]:
    out = []
    dense = [i for i in range(shape.num_layers) if i not in shape.moe_layers]
    if not shape.num_experts:
        out.append("no MoE layer (use the llama family)")
    elif dense:
        out.append(f"dense layers {dense} (every Mixtral layer is MoE)")
    if shape.qk_layernorm:
        out.append("qk_layernorm (Mixtral has no q/k norm: use qwen3_moe)")
    if shape.expert_bias:
        out.append("moe_router_enable_expert_bias (Mixtral's router has no expert bias)")
    if not shape.moe_norm_topk_prob:
        out.append("moe_router_pre_softmax=True (Mixtral renormalises its top-k probabilities)")
    return out


def _unwritten(shape: ModelShape) -> tuple[tuple[str, bool], ...]:
    """What a shape read from an HF config can say and no converted family computes."""
    return (
        (f"rope_scaling={shape.rope_scaling!r}", shape.rope_scaling not in ("", "yarn")),
        ("an L2 q/k norm", shape.qk_l2_norm),
        ("an attention output bias", shape.out_bias),
        ("sandwich norms", shape.sandwich_norms),
        ("a gated shared expert", shape.shared_expert_gate),
    )


def shape_from_megatron(config: Any, gpt: Any, family: Family | str | None = None) -> ModelShape:
    """The shape of the (unwrapped) `GPTModel` `gpt` built with the `TransformerConfig` `config`;
    the family is `family_of(config)` unless given.

    Raises ValueError naming every setting HF's `family` cannot compute the same way."""
    if family is not None and family not in set(Family):
        raise ValueError(f"no family {family!r}: colocate converts to\n{support_table()}")
    family = family_of(config) if family is None else Family(family)
    problems = _megatron_problems(config, gpt)
    if problems:
        raise ValueError(f"no HF {family.value} equivalent: " + "; ".join(problems))
    return checked(megatron_shape(config, gpt, family))


def megatron_shape(config: Any, gpt: Any, family: Family) -> ModelShape:
    """What `config` and `gpt` read as, before the converter's refusals (`shape_from_megatron`
    applies them): the shape a served config is compared with (served.py)."""
    experts = config.num_moe_experts or 0
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=gpt.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size,
        max_position_embeddings=gpt.max_sequence_length,
        layernorm_epsilon=config.layernorm_epsilon,
        tie_embeddings=bool(gpt.share_embeddings_and_output_weights),
        qk_layernorm=bool(config.qk_layernorm),
        num_experts=experts,
        moe_ffn_hidden_size=(config.moe_ffn_hidden_size or 0) if experts else 0,
        moe_router_topk=config.moe_router_topk if experts else 0,
        moe_layers=_moe_layers(config) if experts else (),
        expert_bias=bool(experts and config.moe_router_enable_expert_bias),
    )
    attention = mla.megatron_fields(config) or dict(  # MLA's RoPE is in its attention, not the GPTModel
        rotary_base=_rotary_base(gpt),
        rotary_percent=float(getattr(gpt, "rotary_percent", 1.0)),
        qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
    )
    extra = routed.megatron_fields(config) | dsa.megatron_fields(config) | mtp.megatron_fields(config)
    return ModelShape(**fields | attention | extra)


class ModelSpec:
    """The converter's name for a shape before there was one `ModelShape` (docs/conversion.md
    documented it): `ModelSpec(**fields)` is `checked(ModelShape(**fields))`, and its
    constructors are `shape_from_megatron` and `TinyGPTConfig.shape`."""

    def __new__(cls, **fields: Any) -> ModelShape:  # type: ignore[misc]
        return checked(ModelShape(**fields))

    from_megatron = staticmethod(shape_from_megatron)

    @staticmethod
    def from_tiny(cfg: Any, family: Family = Family.LLAMA) -> ModelShape:
        return checked(cfg.shape(family=family))


def _features(spec: ModelShape) -> tuple[tuple[str, bool, frozenset[Family]], ...]:
    """What a model computes beyond Llama and Qwen3(-MoE): (what, whether this one does, the
    families that compute it the same way)."""
    return (
        ("add_qkv_bias", spec.qkv_bias, glm.QKV_BIAS_FAMILIES),
        (f"rotary_percent={spec.rotary_percent:g}", spec.rotary_percent != 1.0, glm.PARTIAL_ROTARY_FAMILIES),
        ("multi_latent_attention", spec.mla, mla.MLA_FAMILIES),
        ("YaRN RoPE", spec.yarn, mla.MLA_FAMILIES),
        (
            f"moe_router_score_function={spec.moe_score_function!r}",
            spec.moe_score_function != "softmax",
            routed.ROUTED_FAMILIES,
        ),
        ("shared experts", bool(spec.moe_shared_ffn_hidden_size), routed.ROUTED_FAMILIES),
        ("moe_router_num_groups (group-limited routing)", bool(spec.moe_router_num_groups), routed.ROUTED_FAMILIES),
        ("moe_router_topk_scaling_factor", spec.moe_routed_scaling_factor != 1.0, routed.ROUTED_FAMILIES),
        ("a DSA indexer (sparse attention)", bool(spec.dsa_index_n_heads), dsa.DSA_FAMILIES),
    )


def _rotary_base(gpt: Any) -> float:
    """`GPTModel.rotary_base` is the config's when the config has one, while its RoPE was built
    from the constructor's argument: trust the frequencies the RoPE really uses."""
    import torch

    inv_freq = gpt.rotary_pos_emb.inv_freq.detach().cpu().double()
    dim = 2 * inv_freq.numel()
    base = float(gpt.rotary_base)
    expected = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if not torch.allclose(inv_freq, expected, rtol=1e-5):
        found = float((1.0 / inv_freq[1]) ** (dim / 2))
        raise ValueError(f"the model's RoPE frequencies fit a base of about {found:.0f}, not rotary_base={base:g}")
    return base


def _moe_layers(config: Any) -> tuple[int, ...]:
    """The global layers `get_gpt_decoder_layer_specs` makes MoE, from `moe_layer_freq`."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i for i in range(config.num_layers) if i % freq == 0)
    return tuple(i for i, moe in enumerate(freq) if moe)


def _megatron_problems(config: Any, gpt: Any) -> list[str]:
    import torch.nn.functional as F

    checks = {
        f"normalization={config.normalization!r} (HF uses RMSNorm)": config.normalization != "RMSNorm",
        "gated_linear_unit=False (HF's MLP is SwiGLU)": not config.gated_linear_unit,
        "activation_func is not silu": config.activation_func is not F.silu,
        "add_bias_linear=True (HF's linears have no bias)": config.add_bias_linear,
        f"position_embedding_type={gpt.position_embedding_type!r} (HF uses RoPE)": gpt.position_embedding_type
        != "rope",
        "rotary_interleaved=True (HF rotates halves)": getattr(config, "rotary_interleaved", False),
        "rope_scaling=True": bool(getattr(gpt, "rotary_scaling", False)),
    }
    return (
        [problem for problem, bad in checks.items() if bad]
        + mla.megatron_problems(config)
        + routed.megatron_problems(config)
        + dsa.megatron_problems(config)
    )
