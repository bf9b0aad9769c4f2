"""A critic-only step end to end against the transformers engine: the actor does not train, the
engine keeps its version, and it still serves the rollout (issue 10 item 5)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from orchestrator import Lifecycle, LifecycleConfig
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.adapters.transport.bucketed import push_in_buckets
from orchestrator.errors import GuardRejected
from orchestrator.protocols import TransferReport
from orchestrator.testing import InMemoryRegions, InMemoryTrainer
from states import EngineMemory, Phase, Region
from tests.support.rig import make_rig, to_rollout


class _Push:
    """The trainer's bf16 params, HF-named already, pushed in buckets into the engine."""

    def __init__(self, trainer: InMemoryTrainer, engine: TransformersEngine) -> None:
        self.trainer, self.engine = trainer, engine

    def push(self, version: int) -> TransferReport:
        return push_in_buckets(self.trainer.params.items(), self.engine, version, bucket_bytes=1 << 16)


def test_critic_only_step_serves_the_unchanged_version_after_a_full_cycle() -> None:
    engine = TransformersEngine(TinyGPTConfig(), max_batch=4)
    generator = torch.Generator().manual_seed(0)
    mains = {
        name: (1 + 0.2 * torch.randn(p.shape, generator=generator))
        if p.dim() == 1
        else torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5
        for name, p in engine.model.named_parameters()
    }
    trainer = InMemoryTrainer(mains=mains)
    regions = InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop})
    lc = Lifecycle(
        config=LifecycleConfig(), trainer=trainer, regions=regions, engine=engine, transport=_Push(trainer, engine)
    )
    prompts = torch.randint(0, engine.config.vocab_size, (4, 6), generator=generator)

    def rollout() -> torch.Tensor:
        return engine.generate(prompts, max_new_tokens=4, temperature=1.0, seed=7)[0]

    lc.train(trainer.optimizer_step)
    lc.pause_grads()
    lc.update_weights()
    lc.drop_params()
    first = lc.rollout(rollout)
    synced = engine.digests()
    lc.restore()
    assert engine.resident_bytes()[EngineMemory.WEIGHTS] == 0, "restore released the engine's weights"

    lc.pause_grads()  # critic-only: no actor step since the sync
    lc.skip_update()
    lc.drop_params()
    again = lc.rollout(rollout)
    assert lc.phase is Phase.ROLLOUT and engine.weight_version() == 1
    assert engine.digests() == synced, "the engine serves exactly the weights of version 1"
    assert torch.equal(first, again), "same weights, same seed: the same completions"
    lc.restore()


def test_a_critics_work_under_train_keeps_the_fence_and_an_actor_step_lifts_it() -> None:
    """`train` runs whatever work the step has; only the actor's optimizer moving its mains
    (`mains_generation`) makes its weights need a sync. A critic's update under `train` does not."""
    rig = make_rig()
    lc, trainer = rig.lifecycle, rig.trainer
    lc.train(trainer.optimizer_step)
    to_rollout(rig)
    lc.restore()

    critic = torch.nn.Linear(4, 1)
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)

    def critic_step() -> None:
        critic(torch.ones(2, 4)).sum().backward()
        critic_optimizer.step()

    lc.train(critic_step)
    lc.pause_grads()
    with pytest.raises(GuardRejected) as refused:
        lc.update_weights()
    assert [v.guard for v in refused.value.verdicts if not v.ok] == ["weights_changed"]
    lc.skip_update()
    lc.drop_params()
    lc.rollout()
    lc.restore()

    lc.train(trainer.optimizer_step)  # the actor trains: its weights must be pushed, not skipped
    lc.pause_grads()
    with pytest.raises(GuardRejected) as refused:
        lc.skip_update()
    assert [v.guard for v in refused.value.verdicts if not v.ok] == ["weights_unchanged"]
    lc.update_weights()
    assert lc.weight_version == 2
