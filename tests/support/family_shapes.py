"""A tiny `ModelShape` of every family of the support table, with each feature the family's
transformers class computes: for tests that need the engine's model without a Megatron build
(tests/integration/test_engine_decode.py). `SHAPES` has one entry per row of
`orchestrator.models.SUPPORT`, so a family added there fails `shapes_cover_support` until it has one.

Widths: hidden 64, 4 heads, vocab 128, 2-3 layers. Qwen3's embeddings are tied and its q/k
normed; Qwen3-MoE and Mixtral route 4 experts top-2; DeepSeek-V3 is MLA with a q latent (32), a kv
latent (24, not the head dims: the latent cache's width shows), 16 nope + 8 rope dims for q and
k and 12 for v, YaRN, a sigmoid router with `expert_bias`, 2 groups, shared experts and a routed
scale; GLM-4.5 has 24-wide heads in 2 KV groups, q/k/v biases, a q/k norm and half of each head
rotated; GLM-5 is DeepSeek-V3's attention without YaRN plus a DSA indexer in every layer keeping
the top 4 keys, fewer than a test's sequence, so the selection is sparse. Its 16 heads (of 32
dims) make an exact tie rare: a key scores exactly 0 only where every head's relu(q . k) is 0.
"""

from __future__ import annotations

from dataclasses import asdict

from orchestrator.adapters.megatron.convert.spec import checked
from orchestrator.models import SUPPORT, Family, ModelShape

__all__ = ["SHAPES", "shapes_cover_support"]

_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    max_position_embeddings=64,
    rotary_base=500000.0,
    layernorm_epsilon=1e-6,
)
_EXPERTS = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
_DEEPSEEK = ModelShape(
    **{**_BASE, "num_query_groups": 4, "num_layers": 3, "rotary_base": 10000.0},
    family=Family.DEEPSEEK_V3,
    qk_layernorm=True,
    num_experts=8,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_layers=(1, 2),
    expert_bias=True,
    moe_score_function="sigmoid",
    moe_shared_ffn_hidden_size=64,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_routed_scaling_factor=2.5,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rope_scaling="yarn",
    rope_factor=4.0,
    yarn_original_max_position_embeddings=16,
    yarn_mscale_all_dim=0.8,
)
_NO_YARN = dict(rope_scaling="", rope_factor=1.0, yarn_original_max_position_embeddings=0, yarn_mscale_all_dim=0.0)

SHAPES: dict[Family, ModelShape] = {
    Family.LLAMA: ModelShape(**_BASE, family=Family.LLAMA),
    Family.QWEN3: ModelShape(**_BASE, family=Family.QWEN3, qk_layernorm=True, tie_embeddings=True),
    Family.QWEN3_MOE: ModelShape(**_BASE, family=Family.QWEN3_MOE, qk_layernorm=True, **_EXPERTS, moe_layers=(1,)),
    Family.MIXTRAL: ModelShape(**_BASE, family=Family.MIXTRAL, **_EXPERTS, moe_layers=(0, 1)),
    Family.DEEPSEEK_V3: _DEEPSEEK,
    Family.GLM4_MOE: ModelShape(
        **{
            **asdict(_DEEPSEEK),
            **_NO_YARN,
            "family": Family.GLM4_MOE,
            "num_query_groups": 2,
            "head_dim": 24,
            "q_lora_rank": 0,
            "kv_lora_rank": 0,
            "qk_nope_head_dim": 0,
            "qk_rope_head_dim": 0,
            "v_head_dim": 0,
            "qkv_bias": True,
            "rotary_percent": 0.5,
        }
    ),
    Family.GLM_MOE_DSA: ModelShape(
        **{
            **asdict(_DEEPSEEK),
            **_NO_YARN,
            "family": Family.GLM_MOE_DSA,
            "moe_router_num_groups": 0,
            "moe_router_group_topk": 0,
            "moe_routed_scaling_factor": 1.0,
            "dsa_index_n_heads": 16,
            "dsa_index_head_dim": 32,
            "dsa_index_topk": 4,
        }
    ),
}
SHAPES = {family: checked(shape) for family, shape in SHAPES.items()}


def shapes_cover_support() -> list[str]:
    """The support table's families `SHAPES` lacks (empty when it has them all)."""
    return [row.family.value for row in SUPPORT if row.family not in SHAPES]
