"""`colocate check`'s runtime rows: torch_memory_saver and its hook mode on both sides, /dev/shm,
NVLink multicast, and the Ray cluster a run attaches to (docs/check.md says why each).

Each row is judged from facts read once (`SaverFacts`, `HostMemory`, the environment, Ray's
nodes), so the judging functions are pure and a test hands them the facts a machine would show.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import EngineError
from orchestrator.job.check.host import HostMemory
from orchestrator.job.check.memory import gb
from orchestrator.job.check.rows import Outcome, Row, SetUp
from orchestrator.plan.memory import Plan

GROUP = "runtime"
SAVER = "torch_memory_saver"
# Ray 2.60's default object store on a node started without --object-store-memory, as the private
# cluster is (`ray_cluster._start_head`): 30% of the memory available, at most 200 GB, and at most
# max(10 GB, 95% of /dev/shm free) (`ray._private.utils.resolve_object_store_memory`); where /dev/shm
# holds less than that, Ray puts the store in /tmp, "which will harm performance".
RAY_STORE_PROPORTION = float(os.environ.get("RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION", 0.3))
RAY_STORE_MAX = int(os.environ.get("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", 200 * 10**9))
RAY_SHM_THRESHOLD = 10**10
# NCCL makes its shared-memory segments in /dev/shm, and fails to initialise where they do not
# fit; its docs ask containers for --shm-size=1g (docs.nvidia.com/deeplearning/nccl, "Shared memory").
NCCL_SHM = 1 << 30
MULTICAST_ATTRIBUTE = 132  # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
NVLS_VARIABLES = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def ranks_per_node(p: Plan) -> int:
    return min(p.gpus_per_node, p.parallel.world)


# ---- torch_memory_saver ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SaverFacts:
    """torch_memory_saver as this process finds it."""

    version: str | None  # None: not importable
    library_problem: str | None = None  # why hook_mode="torch"'s library does not resolve for this torch
    preloaded: tuple[str, ...] = ()  # LD_PRELOAD's entries that are torch_memory_saver's

    @classmethod
    def read(cls, *, gpus: int, environ: Mapping[str, str] = os.environ) -> SaverFacts:
        preloaded = tuple(p for p in environ.get("LD_PRELOAD", "").split(":") if SAVER in p)
        if importlib.util.find_spec(SAVER) is None:
            return cls(version=None, preloaded=preloaded)
        version = importlib.metadata.version(SAVER)
        problem = None
        if gpus:  # it resolves by the CUDA runtime torch was built for: meaningless without one
            try:
                from torch_memory_saver.utils import get_binary_path_from_package

                get_binary_path_from_package("torch_memory_saver_hook_mode_torch")
            except Exception as exc:  # its own RuntimeError, naming what it looked for
                problem = f"{type(exc).__name__}: {exc}"
        return cls(version=version, library_problem=problem, preloaded=preloaded)


def saver_row(facts: SaverFacts, *, gpus: int) -> Row:
    """The trainer's side. colocate's regions set `hook_mode = "torch"` before torch_memory_saver's
    first use (as Megatron's inference context does): a pluggable allocator of its own library,
    in the rank's process only."""
    check = "torch_memory_saver (trainer)"
    have = f"{SAVER} {facts.version}" if facts.version else f"{SAVER} not importable"
    if not gpus:
        read = f"no GPU: the CPU path frees storages instead (StorageRegions); {have}"
        return Row(group=GROUP, check=check, outcome=Outcome.SKIPPED, read=read)
    if facts.version is None:
        fix = "pip install torch-memory-saver (colocate ran with 0.0.10) into the trainer's environment"
        return Row(group=GROUP, check=check, outcome=Outcome.FAIL, read=have, fix=fix)
    if facts.library_problem:
        fix = "install the torch_memory_saver build for this torch's CUDA (torch.version.cuda)"
        read = f"{have}, hook mode torch: {facts.library_problem}"
        return Row(group=GROUP, check=check, outcome=Outcome.FAIL, read=read, fix=fix)
    read = f"{have}, hook mode torch (set by colocate's regions before its first use)"
    if facts.preloaded:
        read += (
            f"; LD_PRELOAD also loads {', '.join(facts.preloaded)}: the preload hook sees the trainer's allocations too"
        )
        fix = "unset LD_PRELOAD for the trainer: SGLang sets it only for its own schedulers"
        return Row(group=GROUP, check=check, outcome=Outcome.WARN, read=read, fix=fix)
    return Row(group=GROUP, check=check, outcome=Outcome.OK, read=read)


def engine_hook_row(url: str, info: Mapping[str, Any] | None, error: str | None = None) -> Row:
    """An engine's side, from its /server_info. SGLang with `enable_memory_saver` on CUDA runs its
    schedulers under LD_PRELOAD (preload mode, `configure_subprocess`), on XPU in torch mode. A
    process has one mode, and the trainer and the engine are processes of their own, so any pair
    works; an engine without the memory saver has no hook at all."""
    check = f"hook mode, engine {url}"
    if info is None:
        read = f"not read ({error}); the engine rows say why"
        return Row(group=GROUP, check=check, outcome=Outcome.SKIPPED, read=read)
    if not info.get("enable_memory_saver"):  # one failure for one cause: the engine group's
        read = "enable_memory_saver is off: no hook to judge (the engine's `memory saver` row fails for it)"
        return Row(group=GROUP, check=check, outcome=Outcome.SKIPPED, read=read)
    device = str(info.get("device") or "cuda")  # SGLang's ServerArgs resolves None to cuda
    mode = "torch" if device == "xpu" else "preload"
    read = f"{mode} on {device}, in the engine's own processes; the trainer's: torch, in its own"
    return Row(group=GROUP, check=check, outcome=Outcome.OK, read=read)


def server_info(url: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the server's /server_info, None), or (None, why not)."""
    from orchestrator.adapters.engines.sglang.client import SGLangEngine

    client = SGLangEngine(url, read_timeout_s=10.0, retries=0)
    try:
        return client.server_info(), None
    except EngineError as exc:
        return None, str(exc)
    finally:
        client.close()


# ---- /dev/shm ---------------------------------------------------------------------------------


def ray_store_bytes(available: int, shm_free: int) -> int:
    """The object store Ray gives a node started with no --object-store-memory."""
    cap = min(RAY_STORE_MAX, max(RAY_SHM_THRESHOLD, int(shm_free * 0.95)))
    return min(int(available * RAY_STORE_PROPORTION), cap)


def shm_row(p: Plan, host: HostMemory, *, available: int, gpus: int) -> Row:
    check = "/dev/shm"
    if host.shm_free is None:
        read = "no /dev/shm: Ray's object store and NCCL's segments have nowhere to go"
        return Row(group=GROUP, check=check, outcome=Outcome.FAIL, read=read, fix="mount a tmpfs at /dev/shm")
    store = ray_store_bytes(available, host.shm_free)
    read = f"{gb(host.shm_free)} free of {gb(host.shm_size or 0)}; Ray's object store takes {gb(store)}"
    nccl = gpus > 0 and ranks_per_node(p) > 1
    if nccl:
        read += f"; NCCL's segments of {ranks_per_node(p)} ranks a node"
    # CUDA IPC moves no bytes through /dev/shm: the staging buffer is device memory, and only
    # torch's handles and reference counts (a few KB) cross.
    if nccl and host.shm_free < NCCL_SHM:
        fix = f"enlarge /dev/shm to {gb(NCCL_SHM)} at least (Docker: --shm-size=1g)"
        return Row(group=GROUP, check=check, outcome=Outcome.FAIL, read=read + ": NCCL fails to initialise", fix=fix)
    if store > host.shm_free:
        read += ", more than /dev/shm holds: Ray puts it in /tmp, which harms performance"
        fix = f"enlarge /dev/shm to {gb(store * 1.1)} (Docker: --shm-size), as Ray advises"
        return Row(group=GROUP, check=check, outcome=Outcome.WARN, read=read, fix=fix)
    return Row(group=GROUP, check=check, outcome=Outcome.OK, read=read)


# ---- NVLink multicast -------------------------------------------------------------------------


def multicast_supported(gpus: int) -> bool | None:
    """Whether a visible GPU supports NVLink multicast (NVLS), asked of the driver by attribute:
    no multicast object is made. None where the driver cannot be asked."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if cuda.cuInit(0) != 0:
        return None
    device, value = ctypes.c_int(), ctypes.c_int()
    for index in range(gpus):
        if cuda.cuDeviceGet(ctypes.byref(device), index) != 0:
            return None
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), MULTICAST_ATTRIBUTE, device) != 0:
            return None
        if value.value:
            return True
    return False


def nvls_row(p: Plan, environ: Mapping[str, str], *, gpus: int, multicast: bool | None) -> Row:
    """NCCL builds NVLink SHARP buffers for each communicator where the GPUs support multicast
    (NCCL_NVLS_ENABLE unset: on). They are device memory outside every region and outside the plan:
    they stay on the GPU through the rollout, beside the engine. SGLang keeps them off in its own
    processes unless --enable-nccl-nvls; the trainer's are the ones to set."""
    check = "NVLink multicast"
    shown = ", ".join(f"{name}={environ[name]}" for name in NVLS_VARIABLES if name in environ) or "none set"
    if not gpus:
        return Row(group=GROUP, check=check, outcome=Outcome.SKIPPED, read=f"no GPU; {shown}")
    read = f"{shown}; "
    if ranks_per_node(p) < 2:
        return Row(group=GROUP, check=check, outcome=Outcome.OK, read=read + "one rank a node: no NCCL group in a node")
    if multicast is False:
        return Row(group=GROUP, check=check, outcome=Outcome.OK, read=read + "no GPU here supports multicast")
    if environ.get("NCCL_NVLS_ENABLE") == "0":
        return Row(group=GROUP, check=check, outcome=Outcome.OK, read=read + "NCCL's NVLS is off")
    support = "the GPUs support multicast" if multicast else "multicast support unread"
    read += f"{support}: NCCL builds NVLS buffers outside every region and the plan, kept through the rollout"
    fix = "export NCCL_NVLS_ENABLE=0 for the trainer (SGLang keeps it off unless --enable-nccl-nvls)"
    return Row(group=GROUP, check=check, outcome=Outcome.WARN, read=read, fix=fix)


# ---- the Ray cluster --------------------------------------------------------------------------


def cluster_row(p: Plan, address: str, nodes: Sequence[Mapping[str, float]]) -> Row:
    """The cluster's alive nodes' resources against the layout: in all, as `capacity` judges an
    attached cluster (a CPU and a GPU a rank; the SGLang servers take no bundle), and per node,
    the ranks the layout puts on one (`--gpus-per-node`)."""
    from orchestrator.job.capacity import cluster_problems

    world, per_node = p.parallel.world, ranks_per_node(p)
    total: dict[str, float] = {}
    for node in nodes:
        for key, value in node.items():
            total[key] = total.get(key, 0.0) + value
    problems = cluster_problems(total, address=address, ranks=world, cuda=True, engine_bundle=False)
    needed = math.ceil(world / p.gpus_per_node)
    fitting = [n for n in nodes if min(n.get("GPU", 0.0), n.get("CPU", 0.0)) >= per_node]
    if len(fitting) < needed:
        problems.append(
            f"the layout puts {per_node} ranks on each of {needed} node(s) (--gpus-per-node {p.gpus_per_node}), "
            f"and {len(fitting)} node(s) have {per_node} GPUs and CPUs"
        )
    shown = "; ".join(f"{n.get('GPU', 0):g} GPU, {n.get('CPU', 0):g} CPU" for n in nodes)
    read = f"{address}: {len(nodes)} node(s) ({shown}) for {world} ranks"
    if not problems:
        return Row(group=GROUP, check="Ray cluster", outcome=Outcome.OK, read=read)
    fix = f"add nodes of {per_node} GPUs and CPUs each (ray start --address), or a layout the cluster holds"
    return Row(group=GROUP, check="Ray cluster", outcome=Outcome.FAIL, read=f"{read}: {'; '.join(problems)}", fix=fix)


def ray_nodes(address: str) -> list[dict[str, float]]:
    """The resources of the alive nodes of the cluster at `address`, read as its driver (attached
    and detached again: nothing is started there)."""
    import ray

    from orchestrator.job.ray_cluster import attach

    cluster = attach(address, runtime_env={})
    try:
        return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    finally:
        cluster.close()


def ray_row(p: Plan, address: str | None) -> Row:
    if address is None:
        read = "no --ray-address: the run starts a cluster of its own on this machine (the memory rows judge it)"
        return Row(group=GROUP, check="Ray cluster", outcome=Outcome.SKIPPED, read=read)
    from orchestrator.errors import RayUnreachable
    from orchestrator.job.ray_cluster import address_problems

    problems = address_problems(address)
    if problems:
        return Row(
            group=GROUP,
            check="Ray cluster",
            outcome=Outcome.FAIL,
            read="; ".join(problems),
            fix="--ray-address HOST:PORT",
        )
    try:
        nodes = ray_nodes(address)
    except RayUnreachable as exc:
        fix = "start it (ray start --head) or give the address it printed; a token cluster needs RAY_AUTH_MODE=token"
        return Row(group=GROUP, check="Ray cluster", outcome=Outcome.FAIL, read=str(exc), fix=fix)
    return cluster_row(p, address, nodes)


def rows(setup: SetUp) -> list[Row]:
    from orchestrator.job.preflight import Machine  # torch, and the job's config: not on import

    machine, host = Machine.probe(), HostMemory.read()
    p, gpus = setup.plan, machine.gpus
    out = [saver_row(SaverFacts.read(gpus=gpus), gpus=gpus)]
    if not setup.engines:
        read = "no --engine given: the engine's hook mode is not read"
        out.append(Row(group=GROUP, check="hook mode, engine", outcome=Outcome.SKIPPED, read=read))
    out += [engine_hook_row(url, *server_info(url)) for url in setup.engines]
    out.append(shm_row(p, host, available=machine.available_bytes, gpus=gpus))
    out.append(nvls_row(p, os.environ, gpus=gpus, multicast=multicast_supported(gpus) if gpus else None))
    out.append(ray_row(p, setup.ray_address))
    return out
