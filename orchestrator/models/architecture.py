"""A decoder-only model's architecture as the numbers an HF config gives it.

`read_config` (orchestrator/models/config.py) makes one from a config mapping; the planner sizes
ranks from it and the converter reads back the configs it writes with it. Plain data: HF's
conventions (defaults, per-type facts, nested `text_config`) are resolved by the reader.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.models.families import Family

__all__ = ["Architecture"]


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """One text model, resolved: every number is what the HF model builds with.

    `moe_layers[i]` says whether decoder layer i has routed experts. MLA is on when
    `kv_lora_rank` is set; then `head_dim` does not apply and the q/k/v head dims do.
    `not_counted` names the parts of the HF model the numbers leave out (a vision tower);
    `assumed` names what the config did not say and the reader had to assume.
    """

    source: str  # where it was read from, for messages
    name: str  # `_name_or_path`, else the first of `architectures`, else `model_type`
    model_type: str  # the config's own (a multimodal wrapper's, e.g. qwen3_vl)
    text_model_type: str  # its text model's (qwen3_vl_text); = model_type for a text-only config
    architectures: tuple[str, ...] = ()
    family: Family | None = None  # the converter's family, when model_type is one

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # the dense layers' MLP (0 where every layer is MoE)
    qk_norm: bool = False  # learned per-head RMSNorm on q and k
    qk_l2_norm: bool = False  # parameter-free L2 norm on q and k (Llama-4)
    qkv_bias: bool = False
    out_bias: bool = False  # a bias on the attention's output projection too
    sandwich_norms: bool = False  # Gemma: a norm after attention, before and after the MLP
    tie_embeddings: bool = False

    # multi-latent attention (DeepSeek-V3, GLM-5)
    q_lora_rank: int = 0  # 0: q is projected straight from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention's indexer (GLM-5)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    # mixture of experts
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    shared_expert_ffn: int = 0  # all shared experts together
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    router_score: str = "softmax"  # or "sigmoid"
    expert_bias: bool = False  # sigmoid + e_score_correction_bias (DeepSeek's noaux_tc)
    n_group: int = 0  # group-limited routing: groups, and groups a token may pick
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False

    # positions
    rope_theta: float = 0.0
    rope_scaling: str = ""  # the rope type when not the default one (yarn, llama3, ...)
    rope_factor: float = 1.0
    partial_rotary_factor: float = 1.0

    num_mtp_layers: int = 0  # multi-token prediction layers (in Megatron's model, not HF's)
    not_counted: tuple[str, ...] = ()
    assumed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (False,) * self.num_layers)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dense_layers(self) -> int:
        return self.num_layers - sum(self.moe_layers)
