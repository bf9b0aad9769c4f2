"""`orchestrator.adapters.registry`: a name becomes an adapter in one place, and a name nobody
registered is a ConfigError naming it and the names that are known."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from orchestrator.adapters.registry import ENGINES, REGIONS, EngineSpec, Registry
from orchestrator.core.config import Device, EngineKind, WeightSync
from orchestrator.errors import ConfigError


def test_an_unknown_name_is_refused_naming_it_and_the_known_ones() -> None:
    registry: Registry[Callable[[], int]] = Registry("engine", {"b": lambda: 2, "a": lambda: 1})
    with pytest.raises(ConfigError) as caught:
        registry["vllm"]
    assert [str(v) for v in caught.value.violations] == ["unknown engine 'vllm'; known: a, b"]
    assert registry["a"]() == 1


def test_a_name_is_registered_once() -> None:
    registry: Registry[int] = Registry("device", {"cpu": 0})
    registry.register("xpu", 1)
    assert registry.names() == ("cpu", "xpu") and "xpu" in registry
    with pytest.raises(ValueError, match="device 'cpu' is registered already"):
        registry.register("cpu", 2)
    assert registry["cpu"] == 0


def test_every_choice_the_cli_offers_has_an_adapter() -> None:
    """`colocate run`'s --engine, --device and --weight-sync values are the registries' names."""
    pytest.importorskip("ray")  # the weight syncs' registry lives beside the Ray workers
    from orchestrator.job.workers.transports import WEIGHT_SYNCS

    assert ENGINES.names() == tuple(sorted(EngineKind))
    assert REGIONS.names() == tuple(sorted(Device))
    assert WEIGHT_SYNCS.names() == tuple(sorted(WeightSync))
    assert [ENGINES[kind].served for kind in ("transformers", "sglang")] == [False, True]


def test_the_cpu_regions_are_storage_regions_over_the_given_tensors() -> None:
    from orchestrator.adapters.regions.storage import StorageRegions

    tensor = torch.ones(1024)
    regions = REGIONS["cpu"](lambda: {"param_buffer": [tensor]})
    assert isinstance(regions, StorageRegions)
    assert regions.pause("param_buffer") == 4096 and tensor.untyped_storage().nbytes() == 0
    regions.resume("param_buffer")


def test_the_transformers_engine_is_built_on_the_device_asked_for() -> None:
    pytest.importorskip("transformers")
    from orchestrator.adapters.megatron.gpt import TinyGPTConfig

    with ENGINES["transformers"].build(EngineSpec(model=TinyGPTConfig(), max_batch=2, max_len=16)) as engine:
        assert engine.name == "transformers"
        assert {p.device.type for p in engine.model.parameters()} == {"cpu"}  # type: ignore[attr-defined]


def test_a_served_engine_refuses_a_spec_without_urls_before_any_connection() -> None:
    pytest.importorskip("requests")
    spec = EngineSpec(model=None, max_batch=1, max_len=1)
    with pytest.raises(ConfigError, match="no SGLang server URL given"), ENGINES["sglang"].build(spec):
        pass


def test_an_engine_in_the_ranks_process_takes_the_model_in_one_bucket() -> None:
    """In one process the engine is handed views of the params: a bucket holds no copy, so the
    push is one multi-tensor copy; across processes the job's bucket size stands."""
    import sys

    from orchestrator.job.workers.facades import ReplicaSet
    from orchestrator.job.workers.pool import WorkerPool
    from orchestrator.job.workers.transports import RankZeroPush, tensor_push

    ranks = WorkerPool([object()], label="rank", remote=False)
    here = tensor_push(ranks, ReplicaSet(WorkerPool([object()], label="engine", remote=False)), 1 << 20)
    apart = tensor_push(ranks, ReplicaSet(WorkerPool([object()], label="engine", remote=True)), 1 << 20)
    assert isinstance(here, RankZeroPush) and here.bucket_bytes == sys.maxsize
    assert isinstance(apart, RankZeroPush) and apart.bucket_bytes == 1 << 20
