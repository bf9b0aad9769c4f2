"""`colocate run`'s configuration: every problem named at once, before anything starts. Building
a `RunConfig` reads nothing of the machine; `preflight` judges it against a `Machine`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.core.config import Checkpoint, Device, DigestMethod, EngineKind, WeightSync
from orchestrator.errors import ConfigError
from orchestrator.job.config import Cluster, Engine
from orchestrator.job.job import RunConfig
from orchestrator.job.preflight import Machine, fit_problems, preflight

GIB = 1 << 30


def problems(**fields: object) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        RunConfig(**fields)  # type: ignore[arg-type]
    return [str(v) for v in caught.value.violations]


def machine(cores: int = 2, gib: float = 20.0, gpus: int = 0, ray_auth_mode: str | None = None) -> Machine:
    """A machine of `cores` CPUs, `gib` GiB of memory available and `gpus` CUDA devices."""
    return Machine(cores=cores, available_bytes=int(gib * GIB), gpus=gpus, ray_auth_mode=ray_auth_mode)


def test_every_engine_problem_is_named_at_once() -> None:
    found = problems(engine=Engine(kind=EngineKind.SGLANG, urls=("localhost:1", "http://a:1", "http://a:1/")))
    assert found == [
        "--engine-url 'localhost:1': not an http:// or https:// URL",
        "--engine-url http://a:1 given twice",
    ]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"engine": Engine(kind=EngineKind.SGLANG)}, "needs at least one --engine-url"),
        ({"engine": Engine(urls=("http://a:1",))}, "--engine-url is for --engine sglang"),
        ({"engine": Engine(weight_sync=WeightSync.BROADCAST)}, "--weight-sync broadcast is for --engine sglang"),
        (
            {"device": Device.CUDA, "ranks": 2, "engine": Engine(kind=EngineKind.SGLANG, urls=("http://a:1",))},
            "--device cuda --ranks N > 1 runs the transformers engine",
        ),
    ],
)
def test_refused_combinations(fields: dict[str, object], problem: str) -> None:
    assert problem in "\n".join(problems(**fields))


def test_cuda_without_a_device_is_refused() -> None:
    assert fit_problems(RunConfig(device=Device.CUDA, ranks=1), machine(gpus=0)) == [
        "--device cuda: no CUDA device is visible to this process"
    ]


def test_more_gpu_ranks_than_gpus_are_refused() -> None:
    one_gpu = machine(gpus=1)
    assert fit_problems(RunConfig(device=Device.CUDA, ranks=2), one_gpu) == [
        "--device cuda --ranks 2: one rank per GPU, and 1 GPU(s) are visible"
    ]
    assert fit_problems(RunConfig(device=Device.CUDA, ranks=1), one_gpu) == []


def test_the_defaults_and_an_sglang_config_are_accepted() -> None:
    RunConfig()
    RunConfig(engine=Engine(kind=EngineKind.SGLANG, urls=("http://127.0.0.1:30000",), weight_sync=WeightSync.BROADCAST))


@pytest.mark.parametrize(
    ("args", "digest"),
    [((), None), (("--digest", "sha256"), DigestMethod.SHA256), (("--digest", "device"), DigestMethod.DEVICE)],
)
def test_the_digest_flag_reaches_the_job(
    args: tuple[str, ...], digest: DigestMethod | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None lets each rank's trainer choose by its params' device (the device digest on a GPU)."""
    import orchestrator.job.run as demo_run

    seen: list[RunConfig] = []

    def run(config: RunConfig, **_: object) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(demo_run, "run", run)
    done = CliRunner().invoke(app, ["run", *args])
    assert done.exit_code == 0, done.output
    assert seen[0].verify.digest is digest


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"seed": 99999999999999999999999}, "--seed must be >= 0 and < 2**64"),
        ({"seed": 2**64}, "--seed must be >= 0 and < 2**64"),
        (
            {"cluster": Cluster(rank_timeout_s=1e300)},
            "--rank-timeout must be a positive number of seconds, at most 604800 (a week)",
        ),
        ({"cluster": Cluster(rank_timeout_s=604800.5)}, "at most 604800 (a week), got 604800.5"),
    ],
)
def test_numbers_past_what_their_use_takes_are_refused(fields: dict[str, object], problem: str) -> None:
    """The seed goes to torch.Generator.manual_seed (64 bits), the timeout to Ray's and threading's waits."""
    assert problem in "\n".join(problems(**fields))


def test_the_largest_numbers_allowed_are_taken_where_they_go() -> None:
    """1e300 overflows each of these (an OverflowError); the largest allowed value does not."""
    import socket
    import threading

    config = RunConfig(seed=2**64 - 1, cluster=Cluster(rank_timeout_s=604800.0))
    torch.Generator().manual_seed(config.seed)
    assert threading.Lock().acquire(timeout=config.cluster.rank_timeout_s)  # a free lock: at once
    with socket.socket() as probe:
        probe.settimeout(config.cluster.rank_timeout_s)


def test_more_ranks_than_this_machine_holds_are_refused_naming_what_it_has() -> None:
    found = fit_problems(RunConfig(ranks=128), machine(2, 23.0))  # the machine the issue was found on
    assert "--ranks 128: a rank needs a CPU core of its own, and this machine has 2" in found
    assert (
        "--ranks 128: 129 processes need 44.1 GiB of memory at the least, and this machine has 23.0 GiB available"
        in found
    )
    assert fit_problems(RunConfig(ranks=8), machine(64, 2.0)) == [
        "--ranks 8: 9 processes need 3.1 GiB of memory at the least, and this machine has 2.0 GiB available"
    ]


def test_the_default_runs_fit_a_two_core_machine() -> None:
    two_cores = machine(2, 20.0)  # CI's: 2 cores, 24 GiB, some of it taken
    assert fit_problems(RunConfig(), two_cores) == []
    assert fit_problems(RunConfig(ranks=1), two_cores) == []
    assert fit_problems(RunConfig(ranks=1), machine(1, 0.1)) == []  # one rank runs in this process: nothing to judge


def test_an_attached_cluster_is_judged_once_attached_not_by_this_machine() -> None:
    assert fit_problems(RunConfig(ranks=8, cluster=Cluster(ray_address="10.0.0.1:6379")), machine(2, 23.0)) == []


def test_a_private_cluster_without_authentication_is_refused_up_front() -> None:
    unauthenticated = machine(ray_auth_mode="disabled")
    assert fit_problems(RunConfig(ranks=2), unauthenticated) == [
        "RAY_AUTH_MODE=disabled is set, and colocate's own Ray cluster keeps token authentication on: "
        "unset it, or start a cluster yourself and pass --ray-address"
    ]
    assert fit_problems(RunConfig(ranks=1), unauthenticated) == []  # in this process: no Ray
    # The user's cluster: its auth is Ray's business.
    assert fit_problems(RunConfig(ranks=2, cluster=Cluster(ray_address="10.0.0.1:6379")), unauthenticated) == []


def test_building_a_config_reads_nothing_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that cannot hold it, and an environment that refuses a private cluster: the config
    is built all the same; the problems are preflight's."""
    import os

    import psutil

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: pytest.fail("RunConfig read the memory"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("RunConfig asked torch for a GPU"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    RunConfig(ranks=64, device=Device.CUDA)


def test_preflight_reads_this_machine_and_names_its_problems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    found = preflight(RunConfig(ranks=1))
    assert found.cores >= 1 and found.available_bytes > 0
    assert found.gpus == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ConfigError) as refused:
        preflight(RunConfig(ranks=2, checkpoint=Checkpoint(save_every=1, save_dir=tmp_path / "file")))
    assert f"--save-dir {tmp_path / 'file'}: not a folder" in refused.value.violations
    assert any(str(v).startswith("RAY_AUTH_MODE=disabled is set") for v in refused.value.violations)
