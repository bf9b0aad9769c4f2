"""Does a preset's first GRPO step carry a signal? Checked on the CPU, at the preset's vocabulary.

`colocate run --model NAME` samples each completion token from the whole vocabulary of a randomly
initialised model, at the job's temperature, and GRPO learns only from groups whose rewards are
not all equal. This builds the preset's Hugging Face Llama with the same vocabulary and width but
fewer layers (`--layers`; the logits' spread at init is set by the width, not the depth),
samples one step's rollouts of the task `colocate run --model NAME` sets (`presets.grpo_config`),
and prints the share of groups whose rewards differ, the mean reward, and the share of sampled
tokens that read as a task symbol.

`--train-steps N` then runs N GRPO steps of a plain PyTorch loop (Adam at the preset's lr, the
library's clipped loss, one update per rollout) on that reduced model: a cheap look at whether
the reward moves, not the Megatron run.

    python benchmarks/preset_signal.py --model qwen-0.5b [--layers 2] [--prompts 32] [--train-steps 0]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import torch

from orchestrator.adapters.engines.decode import _sample
from orchestrator.adapters.megatron.convert import hf_llama_config
from orchestrator.job.grpo import GRPOConfig, SyntheticTask, group_advantages, grpo_loss
from orchestrator.job.presets import PRESETS, grpo_config


def _model(grpo: GRPOConfig, layers: int, hidden: int | None, seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    cfg = replace(grpo.model, num_layers=layers)
    if hidden is not None:  # narrower: heads and SwiGLU scaled with it, head size kept
        scale = hidden / cfg.hidden_size
        heads = max(cfg.num_query_groups, round(cfg.num_attention_heads * scale))
        heads -= heads % cfg.num_query_groups
        cfg = replace(
            cfg, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=round(cfg.ffn_hidden_size * scale)
        )
    config = hf_llama_config(cfg)
    config.initializer_range = 0.02  # Megatron's init_method_std
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


def _logprobs(model: torch.nn.Module, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    tokens = torch.cat([prompts, completions], dim=1)
    logits = model(input_ids=tokens[:, :-1], logits_to_keep=completions.shape[1]).logits.float()
    return torch.log_softmax(logits, dim=-1).gather(2, completions.unsqueeze(2)).squeeze(2)


@torch.no_grad()
def rollout(
    model: torch.nn.Module, prompts: torch.Tensor, max_new_tokens: int, temperature: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Completions and their log-probs, sampled token by token as the engine does (no cache)."""
    tokens, logps = prompts, list[torch.Tensor]()
    for _ in range(max_new_tokens):
        logits = model(input_ids=tokens, logits_to_keep=1).logits[:, -1]
        token, logp = _sample(logits, temperature, generator)
        tokens, logps = torch.cat([tokens, token.unsqueeze(1)], dim=1), [*logps, logp]
    return tokens[:, prompts.shape[1] :], torch.stack(logps, dim=1)


def step_signal(task: SyntheticTask, prompts: torch.Tensor, completions: torch.Tensor, group: int) -> dict[str, float]:
    rewards = task.rewards(prompts, completions)
    grouped = rewards.view(-1, group)
    read = task.symbols(completions) >= 0
    return {
        "reward_mean": round(float(rewards.mean()), 4),
        "groups_with_spread": round(float((grouped.max(1).values > grouped.min(1).values).float().mean()), 4),
        "tokens_read_as_symbols": round(float(read.float().mean()), 4),
        "distinct_tokens": int(completions.unique().numel()),  # how spread the policy still is
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    grpo = grpo_config(args.model)
    group = args.group_size or grpo.group_size
    task, gen = SyntheticTask(grpo.task), torch.Generator().manual_seed(args.seed)
    model = _model(grpo, args.layers, args.hidden, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or grpo.lr)
    result: dict[str, Any] = {
        "model": args.model, "vocab_size": grpo.model.vocab_size, "layers": args.layers,
        "hidden": args.hidden or grpo.model.hidden_size, "prompts": args.prompts, "group_size": group,
        "temperature": grpo.temperature, "lr": args.lr or grpo.lr, "steps": [],
    }  # fmt: skip
    for step in range(args.train_steps + 1):
        prompts = task.prompts(args.prompts, gen).repeat_interleave(group, 0)
        completions, old = rollout(model, prompts, grpo.max_new_tokens, grpo.temperature, gen)
        signal = step_signal(task, prompts, completions, group)
        result["steps"].append({"step": step + 1, **signal})
        print(json.dumps(result["steps"][-1]), flush=True)
        if step == args.train_steps:
            break
        model.train()
        advantages = group_advantages(task.rewards(prompts, completions), group)
        loss = grpo_loss(_logprobs(model, prompts, completions), old, advantages, torch.ones_like(old), grpo.clip_eps)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grpo.model.clip_grad)
        optimizer.step()
        model.eval()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=PRESETS, default="qwen-0.5b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None, help="narrower than the preset (default: its width)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (the job's default: 128)")
    parser.add_argument("--group-size", type=int, default=0, help="0: the preset's")
    parser.add_argument("--lr", type=float, default=0.0, help="0: the preset's")
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON at the end")
    args = parser.parse_args()
    result = measure(args)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
