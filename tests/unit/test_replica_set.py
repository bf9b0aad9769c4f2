"""`ReplicaSet` over two in-process engine replicas: one rollout split in contiguous shares, each
replica sampling with its own seed, one call fanned out to both, and replicas that disagree."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.adapters.registry import EngineSpec
from orchestrator.job.workers.engine_replica import EngineReplica
from orchestrator.job.workers.facades import ReplicaSet
from orchestrator.job.workers.pool import WorkerPool
from states import EngineMemory

CFG = TinyGPTConfig()


def replicas(count: int) -> list[EngineReplica]:
    spec = EngineSpec(model=CFG, max_batch=8 // count, max_len=16)
    return [EngineReplica("transformers", spec, index=i, replicas=count) for i in range(count)]


def synced(workers: list[EngineReplica]) -> ReplicaSet:
    engine = ReplicaSet(WorkerPool(workers, label="engine", remote=False))
    source = workers[0].engine.model.state_dict()
    engine.update_weights([(n, t.clone()) for n, t in source.items() if n in workers[0].engine._params], 1)
    return engine


def test_a_rollout_is_split_in_contiguous_shares_each_with_its_seed() -> None:
    two = synced(replicas(2))
    prompts = torch.randint(0, CFG.vocab_size, (8, 4), generator=torch.Generator().manual_seed(0))
    completions, logprobs = two.generate(prompts, max_new_tokens=3, temperature=1.0, seed=7)
    assert completions.shape == (8, 3) and logprobs.shape == (8, 3)
    first, second = two.replicas.workers
    alone = [
        replica.engine.generate(prompts[i * 4 : (i + 1) * 4], max_new_tokens=3, temperature=1.0, seed=7 + i)[0]
        for i, replica in enumerate((first, second))
    ]
    assert torch.equal(completions, torch.cat(alone))
    assert two.weight_version() == 1 and two.is_idle()


def test_one_call_reaches_every_replica() -> None:
    two = synced(replicas(2))
    two.release(frozenset({EngineMemory.KV_CACHE}))
    assert all(r.engine.resident_bytes()[EngineMemory.KV_CACHE] == 0 for r in two.replicas.workers)


def test_replicas_that_disagree_match_no_trainer() -> None:
    two = synced(replicas(2))
    agreed = two.digests()
    assert set(agreed) == set(two.replicas.workers[0].engine._params)
    weight = two.replicas.workers[1].engine.model.get_parameter("model.norm.weight")
    weight.data.view(torch.int16)[0] ^= 1
    assert all(name.startswith("replica") for name in two.digests())


def test_a_tag_is_released_only_where_every_replica_released_it() -> None:
    """A release that reached one replica and failed on the other: the set reports the tag held,
    so recover releases it on both (a no-op, with a note, on the one that had)."""
    two = synced(replicas(2))
    first, second = two.replicas.workers
    kv = frozenset({EngineMemory.KV_CACHE})
    first.release(kv)
    assert first.state().released == kv and two.released() == frozenset()
    two.release(kv)
    assert two.released() == kv
    assert all(r.engine.resident_bytes()[EngineMemory.KV_CACHE] == 0 for r in (first, second))
    second.resume(kv)
    assert two.released() == frozenset()
    two.resume(kv)
    assert first.state().released == second.state().released == frozenset()
