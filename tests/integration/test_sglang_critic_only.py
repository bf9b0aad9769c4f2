"""A critic-only step through the SGLang adapter's API: SGLangEngine's requests against the
stand-in server (tests/support/sglang_server.py), which serves them from a transformers model.
The lifecycle drives it; the trainer is the in-memory one (HF-named params), since this checks
what the controller asks of the engine (issue 10 item 5)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("requests")

from orchestrator import Lifecycle, LifecycleConfig
from orchestrator.adapters.engines.sglang import SGLangEngine
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.adapters.transport.bucketed import push_in_buckets
from orchestrator.protocols import TransferReport
from orchestrator.testing import InMemoryRegions, InMemoryTrainer
from states import Phase, Region
from tests.support.sglang_server import SGLangStandIn

pytestmark = pytest.mark.timeout(60)


def test_critic_only_step_through_sglangs_api_serves_the_unchanged_version() -> None:
    model = TransformersEngine(TinyGPTConfig(), max_batch=4)
    generator = torch.Generator().manual_seed(0)
    mains = {
        name: (1 + 0.2 * torch.randn(p.shape, generator=generator))
        if p.dim() == 1
        else torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5
        for name, p in model.model.named_parameters()
    }
    trainer = InMemoryTrainer(mains=mains)
    regions = InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop})
    prompts = torch.randint(0, model.config.vocab_size, (2, 5), generator=generator).tolist()
    with SGLangStandIn(model=model) as server:
        engine = SGLangEngine(server.url, flush_max_wait_s=2.0, flush_poll_s=0.01)

        class Push:
            def push(self, version: int) -> TransferReport:
                return push_in_buckets(trainer.params.items(), engine, version, bucket_bytes=1 << 16)

        lc = Lifecycle(config=LifecycleConfig(), trainer=trainer, regions=regions, engine=engine, transport=Push())

        def rollout() -> list[list[int]]:
            out = engine.generate(prompts, {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 5})
            assert all(g.weight_version == "1" for g in out)
            return [g.token_ids for g in out]

        lc.train(trainer.optimizer_step)
        lc.pause_grads()
        lc.update_weights()
        lc.drop_params()
        first = lc.rollout(rollout)
        lc.restore()
        assert "weights" in server.state.released

        lc.pause_grads()  # critic-only: the actor did not train
        lc.skip_update()
        lc.drop_params()
        assert lc.rollout(rollout) == first, "the same weights at the same version, the same seed"
        assert lc.phase is Phase.ROLLOUT and engine.weight_version() == 1
        lc.restore()
        engine.close()
