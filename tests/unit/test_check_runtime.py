"""`colocate check`'s runtime rows, each made to fail for its own reason from the facts a machine
would show; the engine's hook mode from a real HTTP answer (the SGLang stand-in)."""

from __future__ import annotations

import pytest

from orchestrator.cli.plan.options import PlanOptions
from orchestrator.job.check.host import HostMemory
from orchestrator.job.check.rows import Outcome
from orchestrator.job.check.runtime import (
    NCCL_SHM,
    RAY_STORE_PROPORTION,
    SaverFacts,
    cluster_row,
    engine_hook_row,
    nvls_row,
    ray_row,
    ray_store_bytes,
    saver_row,
    server_info,
    shm_row,
)
from orchestrator.plan.memory import Plan

GB = 10**9


@pytest.fixture(scope="module")
def tp2() -> Plan:
    return PlanOptions(model="qwen3-4b", tp=2).plan()


def test_torch_memory_saver_on_this_machine() -> None:
    facts = SaverFacts.read(gpus=0)
    assert saver_row(facts, gpus=0).outcome is Outcome.SKIPPED  # no GPU: never a pass
    if facts.version is None:  # as in this project's venv: on a GPU it would fail
        row = saver_row(facts, gpus=1)
        assert row.outcome is Outcome.FAIL and "pip install torch-memory-saver" in (row.fix or "")


def test_torch_memory_saver_fails_and_warns_for_its_reasons() -> None:
    problem = "RuntimeError: torch_memory_saver: expected exactly one .so matching 'x_cu13.*.so'"
    row = saver_row(SaverFacts(version="0.0.10", library_problem=problem), gpus=1)
    assert row.outcome is Outcome.FAIL and problem in row.read
    env = {"LD_PRELOAD": "/x/libfoo.so:/v/torch_memory_saver_hook_mode_preload_cu12.abi3.so"}
    facts = SaverFacts.read(gpus=0, environ=env)
    assert facts.preloaded == ("/v/torch_memory_saver_hook_mode_preload_cu12.abi3.so",)
    row = saver_row(SaverFacts(version="0.0.10", preloaded=facts.preloaded), gpus=1)
    assert row.outcome is Outcome.WARN and "unset LD_PRELOAD" in (row.fix or "")
    assert saver_row(SaverFacts(version="0.0.10"), gpus=1).outcome is Outcome.OK


def test_the_engine_s_hook_mode_from_its_server_info() -> None:
    from tests.support.sglang_server import SGLangStandIn

    with SGLangStandIn() as server:
        row = engine_hook_row(server.url, *server_info(server.url))
        assert row.outcome is Outcome.OK and row.read.startswith("preload on cpu")  # the stand-in runs on the CPU
        server.state.memory_saver = False
        row = engine_hook_row(server.url, *server_info(server.url))
        assert row.outcome is Outcome.SKIPPED and "memory saver` row fails" in row.read  # not a second failure
        url = server.url
    info, error = server_info(url)  # gone: not judged here, the engine rows fail it
    assert info is None and error
    assert engine_hook_row(url, info, error).outcome is Outcome.SKIPPED
    assert engine_hook_row(url, {"enable_memory_saver": True, "device": "xpu"}).read.startswith("torch on xpu")


def test_dev_shm_for_nccl_and_ray(tp2: Plan) -> None:
    available = 100 * GB
    store = ray_store_bytes(available, 60 * GB)
    assert store == int(available * RAY_STORE_PROPORTION)
    ok = shm_row(tp2, HostMemory(mem_total=1, shm_size=60 * GB, shm_free=60 * GB), available=available, gpus=2)
    assert ok.outcome is Outcome.OK
    small = HostMemory(mem_total=1, shm_size=64 << 20, shm_free=64 << 20)  # Docker's default
    row = shm_row(tp2, small, available=available, gpus=2)
    assert row.outcome is Outcome.FAIL and "NCCL" in row.read and "--shm-size=1g" in (row.fix or "")
    # On the CPU (gloo) NCCL takes none; Ray's store no longer fits and goes to /tmp.
    row = shm_row(tp2, small, available=available, gpus=0)
    assert row.outcome is Outcome.WARN and "/tmp" in row.read
    enough = HostMemory(mem_total=1, shm_size=NCCL_SHM, shm_free=NCCL_SHM)
    assert shm_row(tp2, enough, available=available, gpus=2).outcome is Outcome.WARN  # NCCL's fits, Ray's not
    none = shm_row(tp2, HostMemory(mem_total=1), available=available, gpus=0)
    assert none.outcome is Outcome.FAIL and none.fix == "mount a tmpfs at /dev/shm"


def test_nvlink_multicast(tp2: Plan) -> None:
    assert nvls_row(tp2, {}, gpus=0, multicast=None).outcome is Outcome.SKIPPED
    row = nvls_row(tp2, {}, gpus=2, multicast=True)
    assert row.outcome is Outcome.WARN and row.fix and row.fix.startswith("export NCCL_NVLS_ENABLE=0")
    assert nvls_row(tp2, {"NCCL_NVLS_ENABLE": "1"}, gpus=2, multicast=True).outcome is Outcome.WARN
    assert nvls_row(tp2, {"NCCL_NVLS_ENABLE": "0"}, gpus=2, multicast=True).outcome is Outcome.OK
    assert nvls_row(tp2, {}, gpus=2, multicast=False).outcome is Outcome.OK
    one = PlanOptions(model="qwen3-4b", gpus_per_node=1).plan()
    assert nvls_row(one, {}, gpus=1, multicast=True).outcome is Outcome.OK


def test_a_cluster_s_nodes_against_the_layout(tp2: Plan) -> None:
    assert cluster_row(tp2, "h:1", [{"CPU": 4.0, "GPU": 2.0}]).outcome is Outcome.OK
    row = cluster_row(tp2, "h:1", [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}])  # 2 GPUs, not on one node
    assert row.outcome is Outcome.FAIL and "on each of 1 node(s)" in row.read and "0 node(s) have 2 GPUs" in row.read
    assert "ray start --address" in (row.fix or "")
    assert ray_row(tp2, None).outcome is Outcome.SKIPPED
    bad = ray_row(tp2, "ray://h:1")
    assert bad.outcome is Outcome.FAIL and "Ray Client" in bad.read
