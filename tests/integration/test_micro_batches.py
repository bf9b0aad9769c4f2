"""`grpo_train_step(micro_batch=...)` on a real Megatron-core rank (gloo, CPU): a step's grads add
up over its micro-batches, and the optimizer steps once, on their sum.

The check is exact, so it holds on every CPU. The batch is a set of rows A written twice, [A, A],
trained in two micro-batches of A. Its loss terms are each divided by the token count of [A, A],
2T. So each micro-batch's grads are those of A alone (divided by T) times 1/2, and the two add
up to the grads of A alone. A scale by a power of two is exact in bf16 and fp32 (nothing here
comes near underflow), every op of the backward is linear in the grad it is handed, and the
forward of A has the same shape in both runs. So the grads, and the params after the step, are
bit for bit those of one step on A alone. A step that left a micro-batch out, or stepped after
each one, would differ.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.support.spawn import spawn_ranks

pytest.importorskip("megatron.core")


def _scenario(rank: int, world_size: int, port: int, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        import torch

        from orchestrator.adapters.megatron.build import (
            TinyGPTConfig,
            build_gpt,
            destroy_process_group,
            init_process_group,
        )
        from orchestrator.job.grpo import SyntheticTask, TaskConfig, group_advantages, grpo_train_step

        init_process_group(rank, world_size, port)
        task = SyntheticTask(TaskConfig())
        cfg = TinyGPTConfig(vocab_size=task.config.vocab_size, seq_len=16)
        gen = torch.Generator().manual_seed(7)
        prompts = task.prompts(8, gen)
        completions = torch.randint(0, task.config.vocab_size, (8, task.config.length), generator=gen)
        old = -torch.rand(8, task.config.length, generator=gen) - 1.0  # log-probs near the policy's own
        adv = group_advantages(task.rewards(prompts, completions) + torch.rand(8, generator=gen) * 0.1, 4)

        def step(rows: tuple[torch.Tensor, ...], micro_batch: int) -> tuple[list[torch.Tensor], float]:
            chunks, optimizer = build_gpt(cfg)  # the same seed: the same starting weights
            result["start"] = [p.detach().float().clone() for p in chunks[0].parameters()]
            stats = grpo_train_step(chunks, optimizer, *rows, clip_eps=0.2, micro_batch=micro_batch)
            return [p.detach().float().clone() for p in chunks[0].parameters()], stats.loss

        alone, alone_loss = step((prompts, completions, old, adv), 0)
        twice = tuple(torch.cat([t, t]) for t in (prompts, completions, old, adv))
        micro, micro_loss = step(twice, 8)
        start = result.pop("start")
        result["moved"] = sum(not torch.equal(a, b) for a, b in zip(start, alone, strict=True))
        result["micro_equals_alone"] = all(torch.equal(a, b) for a, b in zip(alone, micro, strict=True))
        result["losses"] = [alone_loss, micro_loss]
        destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_steps_grads_add_up_over_its_micro_batches(tmp_path: Path) -> None:
    (result,) = spawn_ranks(_scenario, 1, tmp_path, timeout=240)
    assert result["micro_equals_alone"], "two micro-batches of A did not give the step of A alone"
    assert result["losses"][0] == result["losses"][1]
    assert result["moved"] > 0, "the check cannot fail: the step moved no param"
