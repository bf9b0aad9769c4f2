"""The GRPO pieces that need no Megatron: task rewards, group advantages, the clipped loss."""

from __future__ import annotations

import pytest
import torch

from orchestrator.errors import ConfigError
from orchestrator.job.grpo import SyntheticTask, TaskConfig, group_advantages, grpo_loss

TASK = SyntheticTask(TaskConfig(alphabet_size=8, length=4))


def test_prompts_are_bos_symbols_sep() -> None:
    prompts = TASK.prompts(5, torch.Generator().manual_seed(0))
    assert prompts.shape == (5, 6) and prompts.dtype == torch.long
    assert (prompts[:, 0] == 8).all() and (prompts[:, -1] == 9).all()
    assert ((prompts[:, 1:-1] >= 0) & (prompts[:, 1:-1] < 8)).all()


def test_reward_is_fraction_of_positions_copied() -> None:
    prompts = torch.tensor([[8, 1, 2, 3, 4, 9]] * 4)
    completions = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0], [0, 0, 0, 0], [4, 3, 2, 1]])
    assert TASK.rewards(prompts, completions).tolist() == [1.0, 0.5, 0.0, 0.0]


def test_reward_rejects_wrong_completion_length() -> None:
    with pytest.raises(ValueError, match="completions must be"):
        TASK.rewards(torch.tensor([[8, 1, 2, 3, 4, 9]]), torch.tensor([[1, 2, 3]]))


def test_task_config_reports_every_problem() -> None:
    with pytest.raises(ConfigError) as caught:
        TaskConfig(alphabet_size=1, length=0)
    assert len(caught.value.violations) == 2
    with pytest.raises(ConfigError, match="vocab_size must hold the alphabet, BOS and SEP"):
        TaskConfig(alphabet_size=8, vocab_size=9)


def test_default_vocabulary_is_one_id_per_symbol_then_bos_and_sep() -> None:
    cfg = TaskConfig()
    assert (cfg.vocab_size, cfg.bos, cfg.sep, cfg.tokens_per_symbol) == (10, 8, 9, 1)
    assert TaskConfig() == TaskConfig(vocab_size=10)


WIDE = SyntheticTask(TaskConfig(alphabet_size=8, length=4, vocab_size=32))  # 3 ids per symbol, 6 spare


def test_wide_vocabulary_reads_each_id_as_its_symbol_mod_the_alphabet() -> None:
    cfg = WIDE.config
    assert (cfg.bos, cfg.sep, cfg.tokens_per_symbol) == (30, 31, 3)
    ids = torch.arange(32)
    expected = [i % 8 for i in range(24)] + [-1] * 8  # 24..29 spare, then BOS and SEP
    assert WIDE.symbols(ids).tolist() == expected


def test_wide_vocabulary_prompts_write_each_symbol_as_its_own_id() -> None:
    prompts = WIDE.prompts(50, torch.Generator().manual_seed(0))
    assert (prompts[:, 0] == 30).all() and (prompts[:, -1] == 31).all()
    assert ((prompts[:, 1:-1] >= 0) & (prompts[:, 1:-1] < 8)).all()


def test_wide_vocabulary_rewards_every_id_of_the_right_symbol() -> None:
    prompts = torch.tensor([[30, 1, 2, 3, 4, 31]] * 4)
    completions = torch.tensor([[1, 2, 3, 4], [9, 18, 11, 20], [25, 30, 31, 0], [17, 2, 27, 4]])
    assert WIDE.rewards(prompts, completions).tolist() == [1.0, 1.0, 0.0, 0.75]


def test_a_uniform_policy_scores_one_in_alphabet_size_whatever_the_vocabulary() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (10, 32768, 65536):
        task = SyntheticTask(TaskConfig(vocab_size=vocab))
        prompts = task.prompts(4096, gen)
        rewards = task.rewards(prompts, torch.randint(0, vocab, (4096, 4), generator=gen))
        assert ((rewards >= 0) & (rewards <= 1)).all()
        share = task.config.alphabet_size * task.config.tokens_per_symbol / vocab  # ids that are a symbol
        assert rewards.mean().item() == pytest.approx(share / 8, abs=0.01)


def test_advantages_are_zero_mean_unit_scale_per_group() -> None:
    rewards = torch.tensor([0.0, 0.25, 0.5, 1.0, 0.1, 0.1, 0.9, 0.3])
    adv = group_advantages(rewards, group_size=4).view(2, 4)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv.std(dim=1, unbiased=False), torch.ones(2), atol=1e-3)
    # Order within a group is preserved: a better completion gets a larger advantage.
    assert torch.equal(adv[0].argsort(), torch.arange(4))


def test_all_equal_group_has_zero_advantages() -> None:
    adv = group_advantages(torch.tensor([0.5, 0.5, 0.5, 0.0, 1.0, 0.0]), group_size=3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3:].abs().sum() > 0


def test_advantages_reject_partial_groups() -> None:
    with pytest.raises(ValueError, match="whole number of groups"):
        group_advantages(torch.zeros(5), group_size=2)


def test_loss_on_policy_is_minus_mean_advantage_over_tokens() -> None:
    logp = torch.log(torch.full((2, 3), 0.5))
    adv = torch.tensor([1.0, -3.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss = grpo_loss(logp, logp.clone(), adv, mask, clip_eps=0.2)
    # ratio 1 everywhere: -(3 * 1 + 1 * -3) / 4 tokens
    assert loss.item() == pytest.approx(0.0)
    loss = grpo_loss(logp, logp.clone(), torch.tensor([1.0, 1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.0)


def _one_token(ratio: float, advantage: float, clip_eps: float = 0.2) -> tuple[float, float]:
    """Loss and d(loss)/d(logp) for one token whose ratio to the old policy is ``ratio``."""
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-torch.log(torch.tensor(ratio)).item()]])
    loss = grpo_loss(logp, old, torch.tensor([advantage]), torch.ones(1, 1), clip_eps)
    loss.backward()
    assert logp.grad is not None
    return loss.item(), logp.grad.item()


@pytest.mark.parametrize(
    ("ratio", "advantage", "clipped_loss"),
    [
        (1.5, 1.0, -1.2),  # gained too much on a good token: capped at 1 + eps, no gradient
        (0.5, -1.0, 0.8),  # dropped too much on a bad token: capped at 1 - eps, no gradient
    ],
)
def test_clipping_active_stops_the_gradient(ratio: float, advantage: float, clipped_loss: float) -> None:
    loss, grad = _one_token(ratio, advantage)
    assert loss == pytest.approx(clipped_loss, rel=1e-5)
    assert grad == 0.0


@pytest.mark.parametrize(
    ("ratio", "advantage"),
    [
        (1.1, 1.0),  # inside the band
        (0.5, 1.0),  # below the band on a good token: the pessimistic min keeps the gradient
        (1.5, -1.0),  # above the band on a bad token: likewise
    ],
)
def test_clipping_inactive_keeps_the_policy_gradient(ratio: float, advantage: float) -> None:
    loss, grad = _one_token(ratio, advantage)
    assert loss == pytest.approx(-ratio * advantage, rel=1e-5)
    assert grad == pytest.approx(-ratio * advantage, rel=1e-5)  # d(-r A)/d logp = -r A


def test_gradient_sign_raises_good_and_lowers_bad_tokens() -> None:
    _, good = _one_token(1.0, 2.0)
    _, bad = _one_token(1.0, -2.0)
    # Gradient descent moves logp by -grad: up for a positive advantage, down for a negative one.
    assert good < 0 < bad


def test_global_token_count_makes_shards_sum_to_the_global_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    logp, old = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    adv = torch.randn(6, generator=gen)
    mask = (torch.rand(6, 4, generator=gen) > 0.3).float()
    whole = grpo_loss(logp, old, adv, mask, 0.2)
    parts = []
    for rank in range(2):
        shard = [t[rank::2] for t in (logp, old, adv, mask)]  # the rows a rank trains on (Batch.shard)
        parts.append(grpo_loss(shard[0], shard[1], shard[2], shard[3], 0.2, num_tokens=mask.sum()))
    # The same 24 fp32 terms summed in two orders: each sum is within 24 x 2^-24 of the sum of
    # their magnitudes (a sum's rounding bound), and so the two within twice that.
    surrogate = (torch.exp(logp - old) * adv.unsqueeze(1)).abs().mul(1.2) * mask  # |ratio A| x (1 + eps) bounds each
    bound = 2 * mask.numel() * 2.0**-24 * float(surrogate.sum() / mask.sum())
    assert abs((parts[0] + parts[1]).item() - whole.item()) <= bound


def test_grpo_config_defaults_fit_the_task_and_refuse_bad_values() -> None:
    from orchestrator.job.grpo import GRPOConfig

    cfg = GRPOConfig()
    assert cfg.max_new_tokens == cfg.task.length
    assert cfg.model.vocab_size == cfg.task.vocab_size and cfg.model.seq_len >= cfg.max_len
    with pytest.raises(ConfigError) as caught:
        GRPOConfig(group_size=1, clip_eps=0.0, task=TaskConfig(alphabet_size=200))
    assert len(caught.value.violations) == 3


def test_grpo_config_refuses_a_model_that_samples_ids_the_task_cannot_read() -> None:
    from orchestrator.adapters.megatron.gpt import TinyGPTConfig
    from orchestrator.job.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"model.vocab_size 32768 != task.vocab_size 10"):
        GRPOConfig(model=TinyGPTConfig(vocab_size=32768))
