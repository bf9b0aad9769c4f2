"""`colocate run`'s configuration: every problem named at once, before anything starts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.core.config import Device, DigestMethod, EngineKind, WeightSync
from orchestrator.errors import ConfigError
from orchestrator.job.job import RunConfig


def problems(**fields: object) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        RunConfig(**fields)  # type: ignore[arg-type]
    return [str(v) for v in caught.value.violations]


def test_every_engine_problem_is_named_at_once() -> None:
    found = problems(engine=EngineKind.SGLANG, engine_urls=("localhost:1", "http://a:1", "http://a:1/"))
    assert found == [
        "--engine-url 'localhost:1': not an http:// or https:// URL",
        "--engine-url http://a:1 given twice",
    ]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"engine": EngineKind.SGLANG}, "needs at least one --engine-url"),
        ({"engine_urls": ("http://a:1",)}, "--engine-url is for --engine sglang"),
        ({"weight_sync": WeightSync.BROADCAST}, "--weight-sync broadcast is for --engine sglang"),
        (
            {"device": Device.CUDA, "ranks": 2, "engine": EngineKind.SGLANG, "engine_urls": ("http://a:1",)},
            "--device cuda --ranks N > 1 runs the transformers engine",
        ),
    ],
)
def test_refused_combinations(fields: dict[str, object], problem: str) -> None:
    assert problem in "\n".join(problems(**fields))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_device_is_refused() -> None:
    assert "no CUDA device is visible" in "\n".join(problems(device=Device.CUDA, ranks=1))


def test_more_gpu_ranks_than_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "--device cuda --ranks 2: one rank per GPU, and 1 GPU(s) are visible" in "\n".join(
        problems(device=Device.CUDA, ranks=2)
    )
    RunConfig(device=Device.CUDA, ranks=1)


def test_the_defaults_and_an_sglang_config_are_accepted() -> None:
    RunConfig()
    RunConfig(engine=EngineKind.SGLANG, engine_urls=("http://127.0.0.1:30000",), weight_sync=WeightSync.BROADCAST)


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
    assert seen[0].digest is digest


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"seed": 99999999999999999999999}, "--seed must be >= 0 and < 2**64"),
        ({"seed": 2**64}, "--seed must be >= 0 and < 2**64"),
        ({"rank_timeout_s": 1e300}, "--rank-timeout must be a positive number of seconds, at most 604800 (a week)"),
        ({"rank_timeout_s": 604800.5}, "at most 604800 (a week), got 604800.5"),
    ],
)
def test_numbers_past_what_their_use_takes_are_refused(fields: dict[str, object], problem: str) -> None:
    """The seed goes to torch.Generator.manual_seed (64 bits), the timeout to Ray's and threading's waits."""
    assert problem in "\n".join(problems(**fields))


def test_the_largest_numbers_allowed_are_taken_where_they_go() -> None:
    """1e300 overflows each of these (an OverflowError); the largest allowed value does not."""
    import socket
    import threading

    config = RunConfig(seed=2**64 - 1, rank_timeout_s=604800.0)
    torch.Generator().manual_seed(config.seed)
    assert threading.Lock().acquire(timeout=config.rank_timeout_s)  # a free lock: at once
    with socket.socket() as probe:
        probe.settimeout(config.rank_timeout_s)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, float], None]:
    """This machine, as RunConfig sees it: `cores` CPUs and `gib` GiB of memory available."""
    import os

    import psutil

    def set_to(cores: int, gib: float) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)))
        available = psutil.virtual_memory()._replace(available=int(gib * (1 << 30)))
        monkeypatch.setattr(psutil, "virtual_memory", lambda: available)

    return set_to


def test_more_ranks_than_this_machine_holds_are_refused_naming_what_it_has(
    machine: Callable[[int, float], None],
) -> None:
    machine(2, 23.0)  # the machine the issue was found on
    found = problems(ranks=128)
    assert "--ranks 128: a rank needs a CPU core of its own, and this machine has 2" in found
    assert (
        "--ranks 128: 129 processes need 44.1 GiB of memory at the least, and this machine has 23.0 GiB available"
        in found
    )
    machine(64, 2.0)
    assert problems(ranks=8) == [
        "--ranks 8: 9 processes need 3.1 GiB of memory at the least, and this machine has 2.0 GiB available"
    ]


def test_the_default_runs_fit_a_two_core_machine(machine: Callable[[int, float], None]) -> None:
    machine(2, 20.0)  # CI's: 2 cores, 24 GiB, some of it taken
    RunConfig()
    RunConfig(ranks=1)
    machine(1, 0.1)  # one rank runs in this process: nothing to judge
    RunConfig(ranks=1)


def test_an_attached_cluster_is_judged_once_attached_not_by_this_machine(machine: Callable[[int, float], None]) -> None:
    machine(2, 23.0)
    RunConfig(ranks=8, ray_address="10.0.0.1:6379")


def test_a_private_cluster_without_authentication_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert problems(ranks=2) == [
        "RAY_AUTH_MODE=disabled is set, and colocate's own Ray cluster keeps token authentication on: "
        "unset it, or start a cluster yourself and pass --ray-address"
    ]
    RunConfig(ranks=1)  # in this process: no Ray
    RunConfig(ranks=2, ray_address="10.0.0.1:6379")  # the user's cluster: its auth is Ray's business
