"""colocate embedded in a Megatron-core GRPO loop: one CPU rank over gloo, a transformers engine.

Run it with `python examples/embed.py [STEPS]` (5 steps by default). docs/megatron.md shows this file.
"""

import socket
import sys
from functools import partial

import torch

from orchestrator import Lifecycle, LifecycleConfig
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.build import build_gpt, destroy_process_group, init_process_group
from orchestrator.adapters.megatron.convert import to_hf
from orchestrator.adapters.megatron.trainer import MegatronTrainer, megatron_setup
from orchestrator.adapters.regions.storage import StorageRegions
from orchestrator.adapters.transport.bucketed import BucketedTransport
from orchestrator.job.grpo import GRPOConfig, SyntheticTask, group_advantages, grpo_train_step
from orchestrator.telemetry.logs import LoggingListener
from orchestrator.telemetry.tracing import TracingListener
from states import Mode

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
grpo = GRPOConfig()  # the copy task and the small Llama-shaped GPT `colocate run` trains
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
init_process_group(rank=0, world_size=1, master_port=port)  # gloo on a CPU, NCCL on a GPU
chunks, optimizer = build_gpt(grpo.model)  # Megatron DDP + DistributedOptimizer (fp32 mains)

trainer = MegatronTrainer(chunks, optimizer)
regions = StorageRegions(trainer.region_tensors)
engine = TransformersEngine(grpo.model, max_batch=grpo.prompts_per_step * grpo.group_size, max_len=grpo.max_len)
transport = BucketedTransport(trainer.sync_tensors, engine, convert=partial(to_hf, cfg=grpo.model))
lc = Lifecycle(
    config=LifecycleConfig(mode=Mode.REMATERIALIZE, setup=megatron_setup(chunks, optimizer)),
    trainer=trainer,
    regions=regions,
    engine=engine,
    transport=transport,
    listeners=[TracingListener(), LoggingListener()],
)

task, generator = SyntheticTask(grpo.task), torch.Generator().manual_seed(0)


def generate(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prompts = task.prompts(grpo.prompts_per_step, generator).repeat_interleave(grpo.group_size, 0)
    completions, logprobs = engine.generate(prompts, max_new_tokens=grpo.max_new_tokens, temperature=1.0, seed=seed)
    return prompts, completions, logprobs


def train_step(prompts: torch.Tensor, completions: torch.Tensor, logprobs: torch.Tensor) -> float:
    advantages = group_advantages(task.rewards(prompts, completions), grpo.group_size)
    stats = grpo_train_step(chunks, optimizer, prompts, completions, logprobs, advantages, clip_eps=grpo.clip_eps)
    return stats.loss


for _ in range(steps):
    with lc.step() as step:
        lc.pause_grads()  # stash extras; pause grads + optimizer state
        lc.update_weights()  # or lc.skip_update() on a critic-only step
        lc.drop_params()  # digest (first N cycles), pause the param buffer, no backup
        samples = lc.rollout(partial(generate, step))
        lc.restore()  # release engine; cast fp32 mains → bf16, all-gather; verify
        loss = lc.train(partial(train_step, *samples))
    reward = task.rewards(samples[0], samples[1]).mean()
    restore = {True: "bit-identical", None: "not checked"}[lc.last_restore_verified]  # a mismatch raises
    print(f"step {step}: mean reward {reward:.3f}, loss {loss:+.4f}, restore {restore}")

destroy_process_group()
