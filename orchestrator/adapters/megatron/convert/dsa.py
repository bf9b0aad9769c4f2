"""GLM-5's DSA (DeepSeek Sparse Attention) indexer: Megatron-core's `DSAIndexer` → transformers'
`GlmMoeDsaIndexer`.

Each DSA layer's indexer scores every earlier token for each query and keeps the top
`index_topk`; the MLA attention then attends to those alone. Its tensors:

| Megatron `self_attention.core_attention.indexer.` | HF `self_attn.indexer.` | rows |
| --- | --- | --- |
| `linear_wq_b` | `wq_b` | per indexer head, from the q latent: `[rope; nope]` in HF |
| `linear_wk` | `wk` | the one key head, from the hidden state: the same |
| `k_norm.weight`, `k_norm.bias` (LayerNorm) | `k_norm.weight`, `k_norm.bias` | the same |
| `linear_weights_proj` | `weights_proj` | one weight per indexer head, as is |

The score is the same function on both sides: `Σ_h w_h · relu(q_h · k) / √(index_head_dim · heads)`
over causal keys, then the top `index_topk`; the query comes from the MLA q latent after its norm
(`q_a_layernorm`), the key through `wk` and the LayerNorm, and both rotate their rope dims in
interleaved pairs, as MLA does. Two things differ:

- **Where the rope dims sit.** megatron-core up to 0.18 rotates the *last* `qk_pos_emb_head_dim`
  dims of each head (`DSAIndexer._apply_rope` splits `[nope, pe]`); HF's indexer (and
  DeepSeek-V3.2's reference) the *first*, as Megatron does from 0.19, whose configs have
  `dsa_indexer_rope_interleaved` (read in 0.16.1, 0.17.0, 0.18.0, 0.19.0 and 0.19.2). For the
  older layout the rows are reordered so the same dims rotate (`spec.dsa_index_rope_first` says
  which). A dot product sums over dims, so the order is free after the rotation but not before
  it: mapping the rows as they are moves most tokens past the logits tolerance, and most queries
  to other keys (the tests show both).
- **Megatron rotates q and k by a Hadamard matrix** (`rotate_activation`, for FP8 kernels); HF
  does not. Scaled by 1/√d the matrix is orthonormal, so q·k is unchanged: only bf16 rounding
  differs, which can flip a near-tie at the k-th place.

megatron-core 0.16.1 runs an indexer in every DSA layer, so the HF config's `indexer_types` is all
`"full"` (0.19's `dsa_indexer_topk_freq` reuses an earlier layer's top-k, GLM-5's `"shared"`
layers: refused, not checked). HF builds `k_norm` with eps 1e-6 whatever the config says; Megatron
uses `layernorm_epsilon` (or 0.19's `dsa_indexer_k_norm_epsilon`), which must be 1e-6. Under TP the
indexer's linears are replicated (`parallel_mode="duplicated"`): each rank holds them whole and
the sync sends rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.adapters.megatron.convert.rules import ANY, LAYER, compile_rules, same
from orchestrator.models import Family, ModelShape

__all__ = [
    "DSA_FAMILIES",
    "HF_K_NORM_EPS",
    "RULES",
    "hf_config_keys",
    "indexer_names",
    "megatron_fields",
    "megatron_problems",
    "rope_first",
    "shapes",
    "spec_problems",
]

# The families whose attention selects its keys with a DSA indexer.
DSA_FAMILIES = frozenset({Family.GLM_MOE_DSA})


HF_K_NORM_EPS = 1e-6  # GlmMoeDsaIndexer's LayerNorm, whatever the config says


def rope_first(tensor: torch.Tensor, spec: ModelShape) -> list[torch.Tensor]:
    """Each indexer head's rows (or a norm's entries) in HF's `[rope; nope]` order: a fresh tensor
    from megatron-core ≤ 0.18's `[nope; rope]`, the tensor as it is from 0.19's `[rope; nope]`."""
    if spec.dsa_index_rope_first:
        return [tensor]
    head, rope = spec.dsa_index_head_dim, spec.qk_rope_head_dim
    heads = tensor.reshape(-1, head, *tensor.shape[1:])
    nope_part, rope_part = heads.split([head - rope, rope], dim=1)
    return [torch.cat([rope_part, nope_part], dim=1).reshape(tensor.shape)]


_INDEXER = LAYER + r"self_attention\.core_attention\.indexer\."
_HF = "model.layers.{i}.self_attn.indexer."
RULES = compile_rules(
    (_INDEXER + pattern, (_HF + target,), split, ANY, DSA_FAMILIES)
    for pattern, target, split in (
        (r"linear_wq_b\.weight", "wq_b.weight", rope_first),
        (r"linear_wk\.weight", "wk.weight", rope_first),
        (r"k_norm\.weight", "k_norm.weight", rope_first),
        (r"k_norm\.bias", "k_norm.bias", rope_first),
        (r"linear_weights_proj\.weight", "weights_proj.weight", same),
    )
)


def megatron_fields(config: Any) -> dict[str, Any]:
    """The spec's indexer fields from a `TransformerConfig` whose attention variant is DSA. Configs
    of megatron-core 0.19 and later, whose indexer puts its rope dims first, have
    `dsa_indexer_rope_interleaved`; earlier ones do not."""
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        return {}
    return dict(
        dsa_index_n_heads=config.dsa_indexer_n_heads,
        dsa_index_head_dim=config.dsa_indexer_head_dim,
        dsa_index_topk=config.dsa_indexer_topk,
        dsa_index_rope_first=hasattr(config, "dsa_indexer_rope_interleaved"),
    )


def megatron_problems(config: Any) -> list[str]:
    """What Megatron's attention variant computes that HF's glm_moe_dsa does not (the options
    megatron-core 0.19 added included; absent, they are 0.16's behaviour)."""
    variant = getattr(config, "experimental_attention_variant", None)
    if variant not in (None, "dsa"):
        return [f"experimental_attention_variant={variant!r}"]
    if variant is None:
        return []
    k_norm_eps = getattr(config, "dsa_indexer_k_norm_epsilon", None) or config.layernorm_epsilon
    checks = {
        "DSA without multi_latent_attention (HF's DSA attention is MLA)": not config.multi_latent_attention,
        "dsa_indexer_rope_interleaved=False (HF glm_moe_dsa's indexer rotates interleaved pairs)": not getattr(
            config, "dsa_indexer_rope_interleaved", True
        ),
        "dsa_indexer_scoring_relu=False (HF's index score is a ReLU's)": not getattr(
            config, "dsa_indexer_scoring_relu", True
        ),
        "dsa_indexer_topk_freq / skip_topk_offset (layers sharing a top-k are not converted)": (
            getattr(config, "dsa_indexer_topk_freq", 1) != 1 or getattr(config, "dsa_indexer_skip_topk_offset", 0)
        ),
        f"indexer k norm eps {k_norm_eps:g} (HF's is {HF_K_NORM_EPS:g})": k_norm_eps != HF_K_NORM_EPS,
    }
    return [problem for problem, bad in checks.items() if bad]


def spec_problems(spec: ModelShape) -> list[str]:
    """Why a DSA family's HF model would compute otherwise than the spec says (a DSA indexer in
    another family is refused with the other features, in `spec`)."""
    if spec.family not in DSA_FAMILIES:
        return []
    if not spec.dsa_index_n_heads:
        return [f"no DSA indexer (HF {spec.family.value}'s attention selects its keys with one)"]
    out = []
    if not spec.q_lora_rank:
        out.append("no q_lora_rank (HF's indexer reads the q latent)")
    if not spec.qk_rope_head_dim < spec.dsa_index_head_dim:
        out.append(f"index head dim {spec.dsa_index_head_dim} not above the rope dims {spec.qk_rope_head_dim}")
    return out


def shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF shapes by module name under `self_attn.` (the k norm's weight and bias alike)."""
    head, heads = spec.dsa_index_head_dim, spec.dsa_index_n_heads
    return {
        "indexer.wq_b": (heads * head, spec.q_lora_rank),
        "indexer.wk": (head, spec.hidden_size),
        "indexer.k_norm": (head,),
        "indexer.weights_proj": (heads, spec.hidden_size),
    }


def indexer_names(spec: ModelShape) -> list[str]:
    """A layer's indexer tensors, as HF names them under `model.layers.<i>.`."""
    if spec.family not in DSA_FAMILIES:
        return []
    modules = ["wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"]
    return [f"self_attn.indexer.{module}" for module in modules]


def hf_config_keys(spec: ModelShape) -> dict[str, Any]:
    """`GlmMoeDsaConfig`'s indexer keys: every layer runs its own indexer, as in Megatron."""
    return dict(
        index_n_heads=spec.dsa_index_n_heads,
        index_head_dim=spec.dsa_index_head_dim,
        index_topk=spec.dsa_index_topk,
        indexer_types=["full"] * spec.num_layers,
    )
