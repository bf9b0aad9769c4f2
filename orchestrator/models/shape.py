"""A decoder-only model's shape: the one type the planner, the converter, the builder and the
presets all read.

It is made one way from each source: `read_config` (orchestrator/models/config.py) from an HF
config, `convert.shape_from_megatron` from Megatron's `TransformerConfig` and `GPTModel`, and the
presets write theirs out (orchestrator/plan/presets.py). Megatron's builder reads it to make its
config. Field names are Megatron's `TransformerConfig` names where it has one. Plain data: no
torch, no transformers, so a rank can hand it to a process that has neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import ConfigError
from orchestrator.models.families import Family

__all__ = ["MEGATRON_LAYERNORM_EPS", "ModelShape"]

# TransformerConfig.layernorm_epsilon's default; HF's configs default to 1e-6.
MEGATRON_LAYERNORM_EPS = 1e-5

_REQUIRED = ("hidden_size", "num_layers", "vocab_size", "num_attention_heads", "num_query_groups")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """One text model, resolved: every number is what the model builds with. Checked when built
    (ConfigError naming each problem); what a converter's family cannot compute is checked by the
    converter.

    `moe_layers` lists the indices of the decoder layers whose MLP is a mixture of experts. MLA is
    on when `kv_lora_rank` is set (`mla`); then `head_dim` does not apply and the q/k/v head dims
    do. `head_dim` 0 means `hidden_size // num_attention_heads` (`kv_channels`). RoPE scaling:
    `rope_scaling` names its type ("" for none, "yarn", "llama3", ...) and `rope_factor` its
    factor; the `yarn_*` fields are YaRN's other parameters. `not_counted` names the parts of the
    source model the numbers leave out (a vision tower); `assumed`, what its config did not say.
    """

    name: str = ""
    family: Family | None = None  # the HF family it converts to, when it is one
    # where it was read from: for messages, and the HF config's own types (a multimodal wrapper's
    # model_type, e.g. qwen3_vl, and its text model's, qwen3_vl_text)
    source: str = ""
    model_type: str = ""
    text_model_type: str = ""
    architectures: tuple[str, ...] = ()

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_query_groups: int  # KV heads
    head_dim: int = 0
    ffn_hidden_size: int = 0  # the dense layers' MLP (0 where every layer is MoE)
    max_position_embeddings: int = 0  # 0: not known (an HF config read for planning)
    layernorm_epsilon: float = MEGATRON_LAYERNORM_EPS
    qk_layernorm: bool = False  # learned per-head RMSNorm on q and k
    qk_l2_norm: bool = False  # parameter-free L2 norm on q and k (Llama-4)
    qkv_bias: bool = False
    out_bias: bool = False  # a bias on the attention's output projection too (replicated over TP)
    # Gemma's norms after attention and after the MLP (megatron-core's TransformerLayer has no slot
    # for them; a Gemma layer spec adds its own).
    sandwich_norms: bool = False
    tie_embeddings: bool = False  # Megatron's share_embeddings_and_output_weights
    activation_func: str = "silu"  # the gated MLP's activation, by HF's `hidden_act` name

    # positions
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # the fraction of each head RoPE rotates
    # rotate interleaved pairs (HF's `rope_interleave`; Megatron's MLA always does, its GQA never)
    rotary_interleaved: bool = False
    rope_scaling: str = ""
    rope_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: float = 0.0  # HF's explicit cos/sin scale; 0: inferred from the mscales
    yarn_truncate: bool = True  # HF rounds YaRN's correction range to whole dims (Megatron does)

    # multi-latent attention (DeepSeek-V3, GLM-5): the q latent (0: q projected straight from the
    # hidden state), the kv latent, per-head dims
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention's indexer (GLM-5): heads, head dim, top-k (0: every key attended)
    dsa_index_n_heads: int = 0
    dsa_index_head_dim: int = 0
    dsa_index_topk: int = 0
    dsa_index_rope_first: bool = False  # megatron-core >= 0.19's indexer layout (see convert/dsa.py)
    # layers whose indexer reuses an earlier layer's top-k (HF's `indexer_types` "shared")
    dsa_shared_index_layers: tuple[int, ...] = ()

    # mixture of experts
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities (Megatron's default)
    expert_bias: bool = False  # sigmoid + e_score_correction_bias (DeepSeek's noaux_tc)
    moe_score_function: str = "softmax"  # or "sigmoid"
    moe_shared_ffn_hidden_size: int = 0  # all shared experts together
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    # group-limited routing: groups, and groups a token may pick; 0 is no grouping, as one group
    # is (Megatron's None, HF's n_group 1)
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    moe_routed_scaling_factor: float = 1.0

    mtp_num_layers: int = 0  # multi-token prediction layers (in Megatron's model, not HF's)
    # colocate's GPT's extras, which the fp32 mains cannot rebuild (beyond expert_bias)
    fp32_param_numel: int = 0  # fp32-dtype params added beside the architecture's
    frozen: tuple[str, ...] = ()  # names of params with requires_grad=False
    not_counted: tuple[str, ...] = ()
    assumed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        object.__setattr__(self, "dsa_shared_index_layers", tuple(self.dsa_shared_index_layers))
        if self.moe_router_num_groups == 1:  # one group of every expert routes as no groups do
            object.__setattr__(self, "moe_router_num_groups", 0)
            object.__setattr__(self, "moe_router_group_topk", 0)
        problems = self.problems()
        if problems:
            raise ConfigError([f"model {self.name or self.source or '?'}: {p}" for p in problems])

    def problems(self) -> list[str]:
        """What the numbers must satisfy together, whatever the model converts to."""
        ints = {k: v for k, v in vars(self).items() if isinstance(v, int) and not isinstance(v, bool)}
        out = [f"{k} must be >= 0, got {v}" for k, v in ints.items() if v < 0]
        out += [f"{k} must be > 0, got {ints[k]}" for k in _REQUIRED if ints[k] == 0]
        if out:
            return out
        if not self.mla and self.num_attention_heads % self.num_query_groups:
            out.append(f"{self.num_attention_heads} heads do not split into {self.num_query_groups} query groups")
        outside = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        if outside or len(set(self.moe_layers)) != len(self.moe_layers):
            out.append(f"moe_layers {list(self.moe_layers)} must name distinct layers of 0..{self.num_layers - 1}")
        if self.moe_layers and (self.num_experts <= 0 or self.moe_ffn_hidden_size <= 0):
            out.append("MoE layers need num_experts and moe_ffn_hidden_size")
        if self.dense_layers and self.ffn_hidden_size <= 0:
            out.append("dense layers need ffn_hidden_size")
        return out

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def yarn(self) -> bool:
        return self.rope_scaling == "yarn"

    @property
    def kv_channels(self) -> int:
        """A GQA head's dim (Megatron's `kv_channels`)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers)

    @property
    def vocab_row_params(self) -> int:
        """Parameters one vocabulary entry adds: its embedding row, and its output row unless tied."""
        return self.hidden_size * (1 if self.tie_embeddings else 2)
