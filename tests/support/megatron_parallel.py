"""Megatron-core GPTs at any TP, PP and EP on the CPU path, built as a user would: Megatron's own
block spec and GPTModel in Float16Module, DDP and the DistributedOptimizer, trained through
Megatron's own pipeline schedule. For the rank processes of the conversion and embedding tests.

`FAMILIES` are the families `parallel_config` builds a tiny model of: every family of the support
table (`orchestrator.models.SUPPORT`), so a family that claims support is built and checked by the
whole-path test (tests/integration/test_families.py) with no list of its own to extend.

Model: 2 layers, hidden 64, 4 heads in 2 query groups, head 16, ffn 128, vocab 128, RoPE base
500000; MoE: 4 experts (ffn 32), top-2, softmax router; Qwen3-MoE's layer 1 MoE, Mixtral's both.
`tied=True` shares the embedding with the output layer; `grouped_gemm=True` builds the experts
as GroupedMLP (on CPU its one CUDA op stood in for: `tests.support.grouped_gemm`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from orchestrator.adapters.megatron.convert import Family
from orchestrator.models import SUPPORT

__all__ = [
    "BATCH",
    "FAMILIES",
    "SEQ",
    "VOCAB",
    "batches",
    "build",
    "logits",
    "parallel_config",
    "schedule",
    "train_step",
]

SEQ, BATCH, VOCAB = 16, 4, 128
FAMILIES: tuple[Family, ...] = tuple(row.family for row in SUPPORT)


def parallel_config(family: Family, tp: int, pp: int, ep: int, *, grouped_gemm: bool = False) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    moe: dict[str, Any] = {}
    if family in (Family.QWEN3_MOE, Family.MIXTRAL):
        moe = dict(
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
    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        qk_layernorm=family in (Family.QWEN3, Family.QWEN3_MOE),
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
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep if moe else 1,  # a dense model keeps its params data-parallel
        expert_tensor_parallel_size=tp if ep == 1 else 1,
        **moe,
    )


def build(
    family: Family, tp: int, pp: int, ep: int, *, tied: bool = False, grouped_gemm: bool = False
) -> tuple[list[Any], Any]:
    """Megatron's own block spec and GPTModel, in Float16Module, DDP and DistributedOptimizer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if grouped_gemm and not torch.cuda.is_available():
        from tests.support.grouped_gemm import use_cpu_grouped_gemm

        use_cpu_grouped_gemm()
    config = parallel_config(family, tp, pp, ep, grouped_gemm=grouped_gemm)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        ),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=500000,  # not HF's default, so a theta that is not passed through shows
    )
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


def batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(steps)]


def _forward_step(batch: Any, model: Any) -> tuple[torch.Tensor, Any]:
    tokens = next(batch)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand_as(inputs)
    out = model(inputs, positions, None, labels=labels if model.training else None)
    return out, partial(_loss, labels.numel())


def _loss(tokens: int, out: torch.Tensor, non_loss_data: bool = False) -> Any:
    if non_loss_data:  # forward only: the logits, whole over the vocab (TP shards it)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(out).float()
    loss = out.float().sum()
    return loss, torch.tensor(tokens), {"loss": loss.detach()}


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
