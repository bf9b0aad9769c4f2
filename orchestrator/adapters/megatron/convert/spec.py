"""What a conversion needs to know about a model, read from Megatron's own configs.

`ModelSpec.from_megatron(config, gpt)` reads a `TransformerConfig` and the `GPTModel` built from it
(vocab, RoPE base, tied embeddings live on the model, not the config); `ModelSpec.from_tiny(cfg)`
is the thin front the job's `TinyGPTConfig` goes through. A spec is plain data (ints, bools,
a tuple), so the ranks can hand it to a process that has no Megatron.

Only what the HF family can compute the same way is accepted: anything else is refused here,
before a rank starts a collective, with every problem named at once. The fields themselves are
`fields.SpecFields`, below the family modules that read them; the checks and constructors here
call those modules, so they sit above them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.adapters.megatron.convert import dsa, glm, mla, mtp, routed
from orchestrator.adapters.megatron.convert.fields import MEGATRON_LAYERNORM_EPS, SpecFields
from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.models import Family, support_table

__all__ = ["MEGATRON_LAYERNORM_EPS", "Family", "ModelSpec", "SpecFields", "family_of"]


def family_of(config: Any) -> Family:
    """The family a `TransformerConfig` reads as: DSA makes it GLM-5, MLA DeepSeek-V3, sigmoid-routed
    experts GLM-4.5, other experts Qwen3-MoE with a q/k norm and Mixtral without; a dense model is
    Qwen3 with a q/k norm and Llama without. A model the family cannot compute is refused by
    `ModelSpec.from_megatron`."""
    if getattr(config, "experimental_attention_variant", None) == "dsa":
        return Family.GLM_MOE_DSA
    if getattr(config, "multi_latent_attention", False):
        return Family.DEEPSEEK_V3
    if config.num_moe_experts and config.moe_router_score_function == "sigmoid":
        return Family.GLM4_MOE
    if config.num_moe_experts:
        return Family.QWEN3_MOE if config.qk_layernorm else Family.MIXTRAL
    return Family.QWEN3 if config.qk_layernorm else Family.LLAMA


@dataclass(frozen=True, kw_only=True)
class ModelSpec(SpecFields):
    """The shape of a Llama-like GPT, as HF needs it: `SpecFields`'s fields (documented there),
    checked when built. A spec HF's `family` would compute otherwise is refused with every
    problem named, by the base checks here and each family module's `spec_problems`."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"no HF {self.family.value} equivalent: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.num_attention_heads % self.num_query_groups:
            out.append(f"{self.num_attention_heads} heads do not split into {self.num_query_groups} query groups")
        if self.family is Family.LLAMA and self.qk_layernorm:
            out.append("qk_layernorm (Llama has no q/k norm: use the qwen3 family)")
        if self.family in (Family.LLAMA, Family.QWEN3) and self.num_experts:
            moe = "qwen3_moe" if self.qk_layernorm else "mixtral"
            out.append(f"num_experts={self.num_experts} (the {self.family.value} family is dense: use {moe})")
        if self.family is Family.QWEN3 and not self.qk_layernorm:
            out.append("no qk_layernorm (Qwen3 normalises q and k: use the llama family)")
        if self.family is Family.QWEN3_MOE:
            if not self.num_experts or not self.moe_layers:
                out.append("no MoE layer (use the qwen3 family)")
            if not self.qk_layernorm:
                out.append("no qk_layernorm (Qwen3-MoE normalises q and k)")
            if self.expert_bias:
                # Megatron's expert_bias needs sigmoid scores; Qwen3-MoE routes by softmax with
                # no bias, so an engine would pick other experts than the trainer did.
                out.append("moe_router_enable_expert_bias (Qwen3-MoE's router has no expert bias)")
        if self.family is Family.MIXTRAL:
            out += self._mixtral_problems()
        for what, used, families in _features(self):
            if used and self.family not in families:
                others = ", ".join(sorted(f.value for f in families))
                out.append(f"{what} (HF {self.family.value} has no counterpart; {others} do)")
        specific = mla.spec_problems(self) + routed.spec_problems(self) + glm.spec_problems(self)
        return out + specific + dsa.spec_problems(self) + mtp.spec_problems(self)

    def _mixtral_problems(self) -> list[str]:
        out = []
        dense = [i for i in range(self.num_layers) if i not in self.moe_layers]
        if not self.num_experts:
            out.append("no MoE layer (use the llama family)")
        elif dense:
            out.append(f"dense layers {dense} (every Mixtral layer is MoE)")
        if self.qk_layernorm:
            out.append("qk_layernorm (Mixtral has no q/k norm: use qwen3_moe)")
        if self.expert_bias:
            out.append("moe_router_enable_expert_bias (Mixtral's router has no expert bias)")
        if not self.moe_norm_topk_prob:
            out.append("moe_router_pre_softmax=True (Mixtral renormalises its top-k probabilities)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**{**data, "family": Family(data["family"]), "moe_layers": tuple(data["moe_layers"])})

    @classmethod
    def from_tiny(cls, cfg: TinyGPTConfig, family: Family = Family.LLAMA) -> ModelSpec:
        """The job's model: what `megatron_build.build_gpt(cfg)` builds."""
        return cls(
            family=family,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
            head_dim=cfg.hidden_size // cfg.num_attention_heads,
            ffn_hidden_size=cfg.ffn_hidden_size,
            max_position_embeddings=cfg.seq_len,
            rotary_base=float(cfg.rotary_base),
            num_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.ffn_hidden_size if cfg.num_experts else 0,
            moe_router_topk=cfg.moe_router_topk if cfg.num_experts else 0,
            moe_layers=(cfg.num_layers - 1,) if cfg.num_experts else (),
            expert_bias=cfg.num_experts > 0,
        )

    @classmethod
    def from_megatron(cls, config: Any, gpt: Any, family: Family | str | None = None) -> ModelSpec:
        """From a `TransformerConfig` and the (unwrapped) `GPTModel` built with it; the family is
        `family_of(config)` unless given.

        Raises ValueError naming every setting HF's `family` cannot compute the same way."""
        if family is not None and family not in set(Family):
            raise ValueError(f"no family {family!r}: colocate converts to\n{support_table()}")
        family = family_of(config) if family is None else Family(family)
        problems = _megatron_problems(config, gpt)
        if problems:
            raise ValueError(f"no HF {family.value} equivalent: " + "; ".join(problems))
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
        return cls(**fields | attention | extra)


def _features(spec: ModelSpec) -> tuple[tuple[str, bool, frozenset[Family]], ...]:
    """What a model computes beyond Llama and Qwen3(-MoE): (what, whether this one does, the
    families that compute it the same way)."""
    return (
        ("add_qkv_bias", spec.qkv_bias, glm.QKV_BIAS_FAMILIES),
        (f"rotary_percent={spec.rotary_percent:g}", spec.rotary_percent != 1.0, glm.PARTIAL_ROTARY_FAMILIES),
        ("multi_latent_attention", spec.multi_latent_attention, mla.MLA_FAMILIES),
        ("YaRN RoPE", bool(spec.yarn_factor), mla.MLA_FAMILIES),
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
