"""Megatron-core GPTs in DDP + DistributedOptimizer: colocate's own Llama-shaped one (`TinyGPTConfig`)
and one of any family colocate converts (`GPTConfig`), for tests, benchmarks and the job.

Same code on a CPU host (megatron-core 0.16.1 through gloo, with ``enable_cpu_path``) and on a GPU
host (0.19.2 through nccl, as it is): the device is the one the process has.

    init_process_group(rank, world_size, master_port)
    chunks, optimizer = build_gpt(TinyGPTConfig(num_experts=2, fp32_param=True))

`build_gpt` reads the model's `ModelShape` (`cfg.shape()`, what the planner and the converter read
too) to make Megatron's `TransformerConfig` (`megatron_config`, the inverse of
`convert.shape_from_megatron`); the config's training settings (seed, learning rate, clipping) it
reads from the config. A `GPTConfig`'s layers come from Megatron's own spec functions for its
family (`specs.decoder_block_spec`, with its MTP block where the model has one), as a user's
trainer builds them:

    chunks, optimizer = build_gpt(GPTConfig(model=read_config(hf_config_json, source=...), served=...))
    stats = train_step(chunks, optimizer, tokens)   # tokens: [batch, seq_len + 1] int64
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# megatron.core before anything that imports torch_memory_saver (orchestrator/adapters/regions/tms.py says why).
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from orchestrator.adapters.megatron.cpu import enable_cpu_path
from orchestrator.adapters.megatron.gpt import GPTConfig, TinyGPTConfig
from orchestrator.adapters.megatron.megatron_config import UNFUSED, block_keys, megatron_config
from orchestrator.adapters.megatron.specs import decoder_block_spec, mtp_block_spec
from orchestrator.models import ModelShape

__all__ = [
    "FP32_PARAM_NAME",
    "UNFUSED",
    "GPTConfig",
    "StepStats",
    "TinyGPTConfig",
    "build_gpt",
    "destroy_process_group",
    "device",
    "init_process_group",
    "megatron_config",
    "meta_gpt",
    "train_step",
]

FP32_PARAM_NAME = "fp32_output_scale"  # on GPTModel; scales the final norm's output


def device() -> torch.device:
    """The device this process trains on: its current CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """One ``train_step``: this rank's mean token loss, the global grad norm, wall seconds."""

    loss: float
    grad_norm: float | None
    update_successful: bool
    seconds: float


def init_process_group(
    rank: int,
    world_size: int,
    master_port: int,
    backend: str = "gloo",
    *,
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,  # None: TP, as Megatron's default
    seed: int = 1234,
    master_addr: str = "127.0.0.1",
    store: torch.distributed.Store | None = None,
) -> None:
    """torch.distributed + megatron parallel state (PP = 1; TP innermost, as Megatron places it)
    + model-parallel RNG seeds.

    With `store` (a rendezvous store someone already bound) the ranks meet there, and
    `master_port` is not used."""
    if not torch.cuda.is_available():
        enable_cpu_path()
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = timedelta(minutes=5)
    if store is not None:
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        # The address goes in the init method, not in MASTER_ADDR/MASTER_PORT: no process-wide
        # environment is changed per call.
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size, timeout=timeout
        )
    # Gloo groups stay on (the default): get_megatron_optimizer asks for them under nccl too.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    # CPU path: the tracker seeds the CPU generator (see megatron_cpu); GPU: the CUDA one.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_process_group() -> None:
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _transformer_config(shape: ModelShape) -> TransformerConfig:
    moe: dict[str, Any] = {}
    if shape.num_experts > 0:
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.moe_router_topk,
            moe_router_enable_expert_bias=shape.expert_bias,
            moe_router_score_function=shape.moe_score_function,  # softmax is refused with expert_bias
            moe_router_load_balancing_type="none",
            moe_grouped_gemm=False,
            moe_layer_freq=[int(i in shape.moe_layers) for i in range(shape.num_layers)],
            # Must equal initialize_model_parallel's, or experts silently land in dense buffers.
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return TransformerConfig(
        # As initialize_model_parallel made it: Megatron's layers and checks read the config's.
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        **block_keys(),
        **moe,
    )


def _layer_specs(shape: ModelShape) -> TransformerBlockSubmodules:
    dense = get_gpt_layer_local_spec(normalization="RMSNorm")
    specs = [dense] * shape.num_layers
    if shape.moe_layers:
        moe = get_gpt_layer_local_spec(num_experts=shape.num_experts, moe_grouped_gemm=False, normalization="RMSNorm")
        for i in shape.moe_layers:
            specs[i] = moe
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=dense.submodules.input_layernorm)


def _add_fp32_param(gpt: GPTModel) -> None:
    """An fp32 param added after Float16Module's cast, used so that it receives a gradient."""
    dev = gpt.output_layer.weight.device
    scale = torch.nn.Parameter(torch.ones(gpt.config.hidden_size, dtype=torch.float32, device=dev))
    gpt.register_parameter(FP32_PARAM_NAME, scale)

    def apply(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * scale.to(out.dtype)

    gpt.decoder.final_layernorm.register_forward_hook(apply)


def _keep_router_buffers_fp32(gpt: GPTModel) -> None:
    """Float16Module casts router buffers to bf16: token counts above 256 then round."""
    for module in gpt.modules():
        for name in ("expert_bias", "local_tokens_per_expert"):
            buf = getattr(module, name, None)
            if isinstance(buf, torch.Tensor) and buf.dtype != torch.float32:
                buf.data = buf.data.float()


def _on_meta(config: TransformerConfig, meta: bool) -> TransformerConfig:
    """On the meta device: Megatron's layers make their params with no device where
    `use_cpu_initialization` (so on meta, under `torch.device("meta")`), and skip their init."""
    if meta:
        config.use_cpu_initialization, config.perform_initialization = True, False
    return config


def _tiny_gpt(cfg: TinyGPTConfig, meta: bool = False) -> GPTModel:
    shape = cfg.shape()
    return GPTModel(
        config=_on_meta(_transformer_config(shape), meta),
        transformer_layer_spec=_layer_specs(shape),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,  # as the config gives it (an int); the shape's is its float
    )


def _family_gpt(cfg: GPTConfig, meta: bool = False) -> GPTModel:
    """The family's layers by Megatron's own spec functions, an MTP block where it has one."""
    shape = cfg.shape()
    config = _on_meta(megatron_config(shape, init_method_std=cfg.init_method_std), meta)
    block = decoder_block_spec(config)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        mtp_block_spec=mtp_block_spec(config, block),
        vocab_size=shape.vocab_size,
        max_sequence_length=max(shape.max_position_embeddings, cfg.seq_len),
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=shape.rotary_percent,
        rotary_base=shape.rotary_base,  # type: ignore[arg-type]  # Megatron's hint says int; it takes a float
    )


def _module(cfg: TinyGPTConfig | GPTConfig, *, fix_router_count_dtype: bool = True, meta: bool = False) -> Any:
    """The Float16Module(bf16) GPT that `build_gpt` wraps in DDP: its frozen params, its fp32
    param, and its router's buffers in fp32 where asked; on this process's device, or on meta."""
    shape = cfg.shape()
    gpt = _family_gpt(cfg, meta) if isinstance(cfg, GPTConfig) else _tiny_gpt(cfg, meta)
    if not meta:
        gpt.to(device())
    params = dict(gpt.named_parameters())
    for name in shape.frozen:
        params[name].requires_grad_(False)
    model = Float16Module(gpt.config, gpt)
    if shape.fp32_param_numel:
        _add_fp32_param(gpt)
    if fix_router_count_dtype:
        _keep_router_buffers_fp32(gpt)
    return model


def meta_gpt(cfg: TinyGPTConfig | GPTConfig) -> Any:
    """`build_gpt`'s model before DDP, on the meta device: every param's and buffer's name,
    shape, dtype and `requires_grad`, as this megatron-core builds them, and no memory. Call after
    Megatron's parallel state is made (a one-rank one builds the whole model: TP = PP = EP = 1)."""
    with torch.device("meta"):
        return _module(cfg, meta=True)


def build_gpt(
    cfg: TinyGPTConfig | GPTConfig, *, fix_router_count_dtype: bool = True
) -> tuple[list[DistributedDataParallel], ChainedOptimizer]:
    """Float16Module(bf16) GPT in megatron DDP + DistributedOptimizer (Adam, fp32 mains).

    Call after ``init_process_group``. All data-parallel ranks end with identical weights.
    """
    torch.manual_seed(cfg.seed)  # CPU initialisation draws from the CPU generator
    model = _module(cfg, fix_router_count_dtype=fix_router_count_dtype)
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
    )
    chunk = DistributedDataParallel(config, ddp_config, model)
    chunk.broadcast_params()  # frozen params and buffers-less params included
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=cfg.clip_grad,
        weight_decay=0.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [chunk])
    if not isinstance(optimizer, ChainedOptimizer):  # 0.16.1 always chains; be explicit
        optimizer = ChainedOptimizer([optimizer])
    init_optimizer_state(optimizer)
    return [chunk], optimizer


def init_optimizer_state(optimizer: Any) -> None:
    """Give every param its Adam state now, as the first step would: zeroed moments (Megatron's
    own `init_state_fn`) and step 0, where it has none. The first step then runs on the same
    zeros and step as one whose state it makes itself, bit for bit; and the `default` region's
    storages (mains and moments) are final before the first pause, so its host arena is laid out
    once, at set-up, not again at the second pause (54 s for Qwen3-4B's 48 GB on an H200)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer, init_state = getattr(inner, "optimizer", None), getattr(inner, "init_state_fn", None)
        if torch_optimizer is None:
            continue  # not a Megatron optimizer: its first step makes its state
        if init_state is not None:  # Adam's: zeroed moments where there are none
            init_state(torch_optimizer, inner.config)
        for state in torch_optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))  # as torch's Adam makes it (not capturable)


def train_step(
    chunks: list[DistributedDataParallel],
    optimizer: ChainedOptimizer,
    tokens: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    num_microbatches: int = 1,
) -> StepStats:
    """One optimizer step on ``tokens`` [batch, seq + 1]: next-token LM loss, mean over this
    rank's tokens (DDP then averages over data-parallel ranks).

    Grads are finished by ``finalize_model_grads`` (DP reduce-scatter, and the expert_bias update
    that a bare ``finish_grad_sync`` skips), then ``optimizer.step()`` casts and all-gathers.
    """
    start = time.perf_counter()
    (chunk,) = chunks  # one chunk: no pipeline parallelism here
    tokens = tokens.to(device())
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask
    mask = mask.to(device(), torch.float32)
    positions = torch.arange(inputs.shape[1], device=device()).unsqueeze(0).expand_as(inputs)
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    total = mask.sum().clamp(min=1.0)
    loss_sum = torch.zeros((), device=device())
    for part in range(num_microbatches):
        rows = slice(
            part * inputs.shape[0] // num_microbatches,
            (part + 1) * inputs.shape[0] // num_microbatches,
        )
        per_token = chunk(
            inputs[rows], positions[rows], None, labels=labels[rows]
        )  # [b, s] fp32 (Float16Module upcasts)
        loss = (per_token * mask[rows]).sum() / total
        loss.backward()
        loss_sum += loss.detach()
    finalize_model_grads(chunks)
    update_successful, grad_norm, _ = optimizer.step()
    return StepStats(
        loss=float(loss_sum),
        grad_norm=None if grad_norm is None else float(grad_norm),
        update_successful=bool(update_successful),
        seconds=time.perf_counter() - start,
    )
