"""Your own Megatron-core training loop, with colocate as its lifecycle controller.

One rank on the CPU over gloo; the rollout engine is a transformers Llama in this process. Run it
with `python examples/megatron_loop.py [STEPS]` (3 steps by default). docs/megatron.md shows this file.
"""

import sys
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from orchestrator import colocate_megatron, enable_cpu_path
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.embed import gpt_shape

# ---- your trainer, as Megatron-core builds it ----------------------------------------------------
enable_cpu_path()  # megatron-core assumes CUDA: this points it at the CPU (leave it out on a GPU)
torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
parallel_state.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(0)
config = TransformerConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
    normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
    hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
    bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
    gradient_accumulation_fusion=False, persist_layer_norm=False,
)  # fmt: skip
gpt = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128, max_sequence_length=32,
               position_embedding_type="rope", share_embeddings_and_output_weights=False)  # fmt: skip
ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
model = [DistributedDataParallel(config, ddp, Float16Module(config, gpt))]
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True), model)  # fmt: skip

# ---- colocate: one call, then the cycle ------------------------------------------------------------
engine = TransformersEngine(gpt_shape(model), max_batch=8, max_len=32)
lifecycle = colocate_megatron(model, optimizer, engine)  # rematerialize; regions, setup, sync, OTel chosen


def train(tokens: torch.Tensor, rewards: torch.Tensor) -> float:
    """REINFORCE on the sampled sequences: Megatron's forward, backward, grad finalize, step."""
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    per_token = model[0](tokens[:, :-1], positions, None, labels=tokens[:, 1:])  # [batch, seq] loss
    loss = (per_token.mean(1) * (rewards - rewards.mean())).mean()
    loss.backward()
    finalize_model_grads(model)
    optimizer.step()
    return loss.item()


prompts_of = torch.Generator().manual_seed(0)
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    with lifecycle.step() as step:
        lifecycle.pause_grads()  # stash the extras; free grads and optimizer state
        lifecycle.update_weights()  # trainer → engine, Megatron → HF names, in buckets
        lifecycle.drop_params()  # free the bf16 params: no copy kept
        prompts = torch.randint(0, 128, (8, 8), generator=prompts_of)
        rollout = partial(engine.generate, prompts, max_new_tokens=8, temperature=1.0, seed=step)
        completions, _ = lifecycle.rollout(rollout)
        lifecycle.restore()  # rebuild the params from the fp32 mains, bit-identical
        rewards = (completions < 64).float().mean(1)  # the task: tokens from the lower half of the vocabulary
        loss = lifecycle.train(partial(train, torch.cat([prompts, completions], 1), rewards))
    restore = {True: "bit-identical", None: "not checked"}[lifecycle.last_restore_verified]  # a mismatch raises
    print(f"step {step}: reward {rewards.mean():.3f}, loss {loss:+.4f}, restore {restore}")

parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
