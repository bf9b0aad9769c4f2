"""The one look at this machine before a run: what it has, and whether a `RunConfig` fits it.

`RunConfig` reads nothing of the machine, so it is built the same anywhere (a test, a plan, a
future `colocate check`). `preflight` is where the machine is read, once: its CPU cores, the
memory available now, the CUDA devices this process sees, the environment's `RAY_AUTH_MODE`,
and whether `--save-dir` names something other than a folder. `fit_problems` judges a config
against a `Machine` and reads nothing itself."""

from __future__ import annotations

import os
from dataclasses import dataclass

from orchestrator.core.config import Device
from orchestrator.errors import ConfigError
from orchestrator.job.capacity import machine_problems
from orchestrator.job.config import RunConfig
from orchestrator.job.ray_cluster import auth_problems
from orchestrator.job.workers.placement import in_process


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """What a run is judged against: this machine, as `probe` reads it."""

    cores: int  # the CPU cores this process may run on
    available_bytes: int  # memory available now (psutil's `available`)
    gpus: int  # CUDA devices visible to this process; 0 where CUDA is not available
    ray_auth_mode: str | None = None  # the environment's RAY_AUTH_MODE

    @classmethod
    def probe(cls) -> Machine:
        import psutil
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(
            cores=cores,
            available_bytes=psutil.virtual_memory().available,
            gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            ray_auth_mode=os.environ.get("RAY_AUTH_MODE"),
        )


def preflight(config: RunConfig) -> Machine:
    """Read this machine and check that `config` fits it; returns what was read. Raises
    ConfigError naming every problem, before anything starts."""
    machine = Machine.probe()
    problems = fit_problems(config, machine)
    save_dir = config.checkpoint.save_dir
    if save_dir is not None and save_dir.exists() and not save_dir.is_dir():
        problems.append(f"--save-dir {save_dir}: not a folder")
    if problems:
        raise ConfigError(problems)
    return machine


def fit_problems(config: RunConfig, machine: Machine) -> list[str]:
    """What keeps `machine` from running `config`: GPUs for `--device cuda`, and for a private
    Ray cluster, token authentication and a core and some memory per process. A cluster named by
    `--ray-address` is judged once attached (`capacity.cluster_problems`)."""
    problems = []
    if config.device is Device.CUDA and not machine.gpus:
        problems.append("--device cuda: no CUDA device is visible to this process")
    elif config.device is Device.CUDA and config.ranks > machine.gpus:
        problems.append(
            f"--device cuda --ranks {config.ranks}: one rank per GPU, and {machine.gpus} GPU(s) are visible"
        )
    private = config.cluster.ray_address is None and config.ranks >= 1
    if private and not in_process(ranks=config.ranks, device=config.device.value, address=None, cuda=machine.gpus > 0):
        served = config.engine.served
        engine_processes = 0 if served else config.ranks if config.device is Device.CUDA else 1
        problems += auth_problems(machine.ray_auth_mode)
        problems += machine_problems(
            config.ranks, engine_processes=engine_processes, cores=machine.cores, available=machine.available_bytes
        )
    return problems
