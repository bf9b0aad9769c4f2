"""How far a run's mean reward moves by sampling alone: what a "the policy learns" check must clear.

A step's reward (`Job._rollout`) is the mean, over its `prompts_per_step x group_size`
completions, of each one's fraction of the `task.length` positions right: the mean of
n = prompts_per_step x group_size x length Bernoulli trials, each right with the policy's
probability p there. Drawn independently, it has the binomial standard deviation
sqrt(p (1 - p) / n), at most 1 / (2 sqrt(n)) whatever p (`step_reward_sd`). At the CLI's
defaults (`--model tiny`: 128 x 16 x 4 = 8,192 positions) that is 0.0055, and 0.0033 at a random
policy's p of 1/10 (8 symbols in 10 ids).

The trials are independent where the policy barely depends on the prompt, as a random policy's
does: over 10 seeds (`colocate run --steps 6 --ranks 1 --seed S`, this CPU) the first step's
reward spread by 0.0036 about its mean of 0.100, against 0.0033 binomial.

A run whose weights never reach the engine samples one policy at every step: its step rewards are
independent draws about one mean, so the mean of its last m steps less that of its first m has a
mean of 0 and a standard deviation of sqrt(2 / m) x the step's. A rise of `SIGMAS` of those
(`rise_needed`) is learning, not luck: a normal passes 6 sigma with a probability of about 1e-9.
The same 10 runs, learning, rose 0.059-0.075 from their first 2 steps to their last 2 of 6
(0.067 +- 0.006 over the seeds; a CPU whose rounding differs samples another trajectory like
another seed's), against the 0.033 needed there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.job.grpo import GRPOConfig

__all__ = ["SIGMAS", "reward_rise", "rise_needed", "step_reward_sd"]

SIGMAS = 6.0


def step_reward_sd(grpo: GRPOConfig, p: float = 0.5) -> float:
    """The standard deviation of one step's mean reward, sampled from a policy right with
    probability `p` at each position (the default 1/2 bounds it for any p)."""
    positions = grpo.prompts_per_step * grpo.group_size * grpo.task.length
    return math.sqrt(p * (1 - p) / positions)


def rise_needed(grpo: GRPOConfig, steps_each: int, sigmas: float = SIGMAS) -> float:
    """What the mean reward of the last `steps_each` steps must exceed that of the first
    `steps_each` by: `sigmas` standard deviations of that difference for a policy that never
    changes (the two means' variances, sd² / steps_each each, add)."""
    return sigmas * math.sqrt(2 / steps_each) * step_reward_sd(grpo)


def reward_rise(rewards: Sequence[float], steps_each: int) -> float:
    """The mean of the last `steps_each` rewards less that of the first `steps_each`."""
    if len(rewards) < 2 * steps_each:
        raise ValueError(f"{len(rewards)} rewards: too few for two means of {steps_each} steps")
    return (sum(rewards[-steps_each:]) - sum(rewards[:steps_each])) / steps_each
