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
from orchestrator.protocols import TransferReport
from orchestrator.testing import InMemoryRegions, InMemoryTrainer
from states import EngineMemory, Phase, Region


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
