"""Megatron-core GPTs at any TP, PP and EP on the CPU path, built as a user would: Megatron's own
block spec and GPTModel in Float16Module, DDP and the DistributedOptimizer, trained through
Megatron's own pipeline schedule. For the rank processes of the conversion and embedding tests.

`FAMILIES` are the families `parallel_config` builds a tiny model of: every family of the support
table (`orchestrator.models.SUPPORT`), so a family that claims support is built and checked by the
whole-path test (tests/integration/test_families.py) with no list of its own to extend.

Model: 2 layers, hidden 64, 4 heads in 2 query groups, head 16, ffn 128, vocab 128, RoPE base
500000. MoE (Qwen3-MoE, Mixtral): 4 experts (ffn 32), top-2, softmax router; Qwen3-MoE's layer 1
MoE, Mixtral's both. `tied=True` shares the embedding with the output layer; `grouped_gemm=True`
builds the experts as GroupedMLP (on CPU its one CUDA op stood in for: `tests.support.grouped_gemm`).
DeepSeek-V3 and GLM-4.5: layer 1
MoE with 8 experts (ffn 32) in 2 groups, one group and 2 experts a token, a sigmoid router with
`expert_bias`, a routed scale of 2.5, shared experts of ffn 64 (two experts' worth); DeepSeek-V3's
attention MLA (q latent 32, kv latent 32, per head 16 nope + 8 rope dims for q and k, 12 for v)
with YaRN (factor 4 over 4 original positions, mscale 1, mscale_all_dim 0.8, base 10000);
GLM-4.5's heads 24 wide (not hidden / heads), q/k/v with biases, a q/k norm, half of each head
rotated. GLM-5: DeepSeek-V3's attention and MoE layers with a DSA indexer in every layer (4 heads
of 32 dims, the top 4 of up to 16 keys, trained by its KL loss), and one MTP layer; the DSA layer
is built as the package builds it.

The layers are Megatron's own local specs, made as the package makes them
(`orchestrator.adapters.megatron.specs`, which names the seams standing in for Transformer
Engine: MLA's core attention, DSA's replicated linears and Hadamard rotation).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from orchestrator.adapters.megatron.convert import Family
from orchestrator.adapters.megatron.specs import decoder_block_spec, mtp_block_spec
from orchestrator.models import SUPPORT

__all__ = [
    "BATCH",
    "FAMILIES",
    "SEQ",
    "VOCAB",
    "batches",
    "build",
    "layer_spec",
    "logits",
    "mtp_block_spec",
    "parallel_config",
    "schedule",
    "train_step",
]

SEQ, BATCH, VOCAB = 16, 4, 128
FAMILIES: tuple[Family, ...] = tuple(row.family for row in SUPPORT)
ROTARY_PERCENT = {Family.GLM4_MOE: 0.5}

# DeepSeek-style routing (DeepSeek-V3, GLM-4.5): 8 experts in 2 groups of 4; the best group by its
# top-2 biased scores, then its 2 best experts. The bias moves 0.05 a step (Megatron's 1e-3
# would leave it too small after 3 steps for a wrong mapping of it to show).
ROUTED = dict(
    num_moe_experts=8,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.05,
    moe_router_topk_scaling_factor=2.5,
    moe_router_dtype="fp32",  # HF routes in fp32
    moe_shared_expert_intermediate_size=64,
    moe_router_load_balancing_type="none",
    moe_grouped_gemm=False,
    moe_layer_freq=[0, 1],
    moe_token_dispatcher_type="allgather",
)
MLA = dict(
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
    rope_type="yarn",
    rotary_base=10000,
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=SEQ // 4,
    mscale=1.0,
    mscale_all_dim=0.8,
    layernorm_epsilon=1e-6,  # HF's q_a/kv_a norms' eps
)


# GLM-5 (glm_moe_dsa): the indexer keeps 4 of up to 16 keys, so it decides what most queries see.
DSA = dict(
    experimental_attention_variant="dsa",
    dsa_indexer_n_heads=4,
    dsa_indexer_head_dim=32,
    dsa_indexer_topk=4,
    dsa_indexer_loss_coeff=0.1,
    mtp_num_layers=1,
)


def parallel_config(
    family: Family, tp: int, pp: int, ep: int, *, grouped_gemm: bool = False, device: str = "cpu"
) -> Any:
    """The family's tiny `TransformerConfig`; on CUDA (`device`), initialized there, as Megatron's
    own training initializes it (its RoPE tables are made on the device too)."""
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from orchestrator.adapters.megatron.build import UNFUSED

    extra: dict[str, Any] = {}  # the family's keys
    if family in (Family.DEEPSEEK_V3, Family.GLM_MOE_DSA):
        extra = {**ROUTED, **MLA, "num_query_groups": 4}  # MLA: every head its own k and v
    if family is Family.GLM_MOE_DSA:
        extra |= DSA | _rope_interleaved_where_asked(TransformerConfig)
    if family is Family.GLM4_MOE:
        extra = {**ROUTED, "add_qkv_bias": True, "kv_channels": 24}  # as GLM-4.5's, not hidden / heads
    if family in (Family.QWEN3_MOE, Family.MIXTRAL):
        extra = dict(
            num_moe_experts=4,
            moe_ffn_hidden_size=32,
            moe_router_topk=2,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_grouped_gemm=grouped_gemm,
            # Qwen3-MoE: layer 0 dense, layer 1 MoE (both kinds, on both PP stages); Mixtral: all MoE.
            moe_layer_freq=[0, 1] if family is Family.QWEN3_MOE else 1,
            moe_token_dispatcher_type="allgather",
        )
    kind = MLATransformerConfig if "q_lora_rank" in extra else TransformerConfig
    return kind(
        **{"num_query_groups": 2, "kv_channels": 16, **extra},
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        qk_layernorm=family not in (Family.LLAMA, Family.MIXTRAL),
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.125,  # Megatron's 0.02 leaves logits near 0, where a wrong mapping hides
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=device == "cpu",
        **UNFUSED,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep
        if "num_moe_experts" in extra
        else 1,  # a dense model keeps its params data-parallel
        expert_tensor_parallel_size=tp if ep == 1 else 1,
    )


def _rope_interleaved_where_asked(config_class: type) -> dict[str, Any]:
    """megatron-core 0.19 asks whether the indexer's rope interleaves (0.16 to 0.18 always do, as
    MLA): GLM-5's does."""
    import dataclasses

    names = {field.name for field in dataclasses.fields(config_class)}
    return {"dsa_indexer_rope_interleaved": True} if "dsa_indexer_rope_interleaved" in names else {}


def build(
    family: Family, tp: int, pp: int, ep: int, *, tied: bool = False, grouped_gemm: bool = False, device: str = "cpu"
) -> tuple[list[Any], Any]:
    """Megatron's own block spec and GPTModel, in Float16Module, DDP and DistributedOptimizer, on
    `device` ("cpu", or "cuda": the current CUDA device)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if grouped_gemm:
        from tests.support.grouped_gemm import stand_in_where_missing

        stand_in_where_missing()
    config = parallel_config(family, tp, pp, ep, grouped_gemm=grouped_gemm, device=device)
    block = layer_spec(config)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block,
        mtp_block_spec=mtp_block_spec(config, block),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_percent=ROTARY_PERCENT.get(family, 1.0),
        rotary_base=500000,  # not HF's default, so a theta that is not passed through shows
    )
    if device != "cpu":
        gpt.cuda(torch.cuda.current_device())
    _random_qkv_biases(gpt)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunk = DistributedDataParallel(config, ddp, Float16Module(config, gpt))
    chunk.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=0.02,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [chunk],
    )
    return [chunk], optimizer


def _random_qkv_biases(gpt: Any) -> None:
    """Megatron zero-initialises biases, and three steps leave them too small for a wrong split
    of them to show: give q's and k's N(0, 0.5) values instead, v's N(0, 0.05) (v's bias adds
    one vector to every token, as the softmax weights sum to 1; at 0.5 it drowned out the
    token-dependent part of the router's input and every token went to the same experts). The
    whole bias is the same at any TP; each rank takes its shard of it (whole query groups)."""
    from megatron.core import parallel_state as ps

    config = gpt.config
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    heads_per_group = config.num_attention_heads // config.num_query_groups
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, bias in gpt.named_parameters():
            if name.endswith("linear_qkv.bias"):
                whole = torch.randn(
                    config.num_query_groups, heads_per_group + 2, config.kv_channels, generator=generator
                )
                whole[:, :-1] *= 0.5
                whole[:, -1] *= 0.05
                bias.copy_(whole.flatten().chunk(tp)[rank])


def layer_spec(config: Any) -> Any:
    """Megatron's own local block spec, as the package builds it (`specs.decoder_block_spec`:
    MLA's core attention takes its head widths; DSA is Megatron's, built as each version does)."""
    return decoder_block_spec(config)


def batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(steps)]


def _forward_step(batch: Any, model: Any) -> tuple[torch.Tensor, Any]:
    from orchestrator.adapters.megatron.convert.gather import unwrap_gpt

    tokens = next(batch)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ, device=inputs.device).expand_as(inputs)
    gpt = unwrap_gpt(model)
    if not gpt.mtp_process:
        out = model(inputs, positions, None, labels=labels if model.training else None)
        return out, partial(_loss, labels.numel(), [])
    # Megatron's MTP needs the labels in every pass, which then returns the loss: the logits are
    # the output layer's, each MTP layer's first and the main model's last.
    heads: list[torch.Tensor] = []
    hook = gpt.output_layer.register_forward_hook(lambda _m, _i, out: heads.append(out[0].transpose(0, 1)))
    try:
        out = model(inputs, positions, None, labels=labels)
    finally:
        hook.remove()
    return out, partial(_loss, labels.numel(), heads)


def _loss(tokens: int, heads: list[torch.Tensor], out: torch.Tensor, non_loss_data: bool = False) -> Any:
    if non_loss_data:  # forward only: the logits, whole over the vocab (TP shards it)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather

        if not heads:
            return gather(out).float()
        return {"logits": gather(heads[-1]).float(), "mtp": [gather(head).float() for head in heads[:-1]]}
    loss = out.float().sum()
    return loss, torch.tensor(tokens, device=loss.device), {"loss": loss.detach()}


def train_step(chunks: list[Any], optimizer: Any, batch: torch.Tensor) -> None:
    """One optimizer step through Megatron's own schedule (1F1B across the PP stages).

    Megatron refuses to train an MoE layer at TP > 1 without sequence parallelism ("performance
    may degrade"), which its torch norms (no Transformer Engine or apex here) refuse in turn. In
    eval mode the MoE layer computes the same here (no dropout, jitter or aux loss; the router
    still counts tokens for `expert_bias` while grads are on), so such a model trains in eval
    mode: autograd and the optimizer are the same either way."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    moe_at_tp = bool(chunks[0].config.num_moe_experts) and ps.get_tensor_model_parallel_world_size() > 1
    for chunk in chunks:
        chunk.train(not moe_at_tp)
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    schedule(chunks, batch, forward_only=False)
    finalize_model_grads(chunks)
    optimizer.step()


def logits(chunks: list[Any], batch: torch.Tensor) -> torch.Tensor | None:
    """Megatron's logits [batch, seq, vocab] of `batch`'s inputs, whole over the vocab, computed
    across the PP stages by its own schedule: on the last stage, None on the others."""
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        out = schedule(chunks, batch, forward_only=True)
    return out[0] if out else None


def schedule(chunks: list[Any], batch: torch.Tensor, *, forward_only: bool) -> list[Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter([batch]),
        model=chunks,
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )
