"""The Ray cluster the ranks run on: the user's, attached to, or a private one on loopback.

`attach(address)` joins a running cluster as its driver (`ray start --head` on one node, `ray
start --address` on the others). colocate starts no Ray process there; `close` only disconnects,
which ends this job's actors and placement group and leaves the cluster and its other jobs as
they were.

`start_private(cpus)` is the default: a one-node cluster of the run's own, stopped with it. Every
socket it listens on is bound to loopback, and every call to it must carry Ray's token
(`RAY_AUTH_MODE=token`), so that nobody who can reach the machine can submit work to it.

ray is imported inside the functions, so that the rest of colocate imports without it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, RayUnreachable
from orchestrator.job import interrupt
from orchestrator.job.ray_reaper import MARK, start_reaper, stop_reaper

LOOPBACK = "127.0.0.1"
# ray.init rewrites 127.0.0.1 and localhost in an address to this host's outward IP (it assumes
# every node must be reachable from the others), where a loopback-only cluster does not listen.
# The same loopback address, written IPv4-mapped, is one it leaves alone.
LOOPBACK_FOR_RAY = "[::ffff:127.0.0.1]"
REACH_S = 5.0  # how long the address of a cluster may take to accept a connection
HEAD_START_S = 120.0  # `ray start --head` on a loaded machine
# How many tasks' events the private cluster's GCS keeps for Ray's state API (`ray list tasks`),
# the oldest dropped first: Ray's default, 100,000, let the GCS grow with every step of a long run
# (each step is many actor calls; benchmarks/soak.py). A user's RAY_task_events_max_num_task_in_gcs wins.
TASK_EVENTS_KEPT = 1000


@dataclass(frozen=True, slots=True)
class RayCluster:
    """The cluster this process is the driver of."""

    address: str  # the GCS address, as this process connected to it
    private: bool  # started by colocate for this run, and stopped with it
    temp_dir: Path | None  # the private cluster's session folder root; None when attached
    close: Callable[[], None]  # disconnects; a private cluster is stopped and its folder removed too


def address_problems(address: str) -> list[str]:
    """What is wrong with a `--ray-address` (empty: nothing). No connection is tried here."""
    if address.startswith("ray://"):
        return [f"--ray-address {address}: Ray Client (ray://) is not supported; give the GCS address HOST:PORT"]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return [f"--ray-address {address!r}: expected HOST:PORT, the address `ray start --head` prints"]
    return []


def driver_ip(address: str | None) -> str:
    """The IP of this host on the way to the cluster at `address`: where ranks on other nodes
    reach the driver. Loopback for the private cluster, or one given by a loopback address."""
    if address is None or _keep_loopback(address) != address:
        return LOOPBACK
    host, _, port = address.rpartition(":")
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(where)  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise RayUnreachable(address, exc) from exc


def connect(
    address: str | None,
    *,
    cpus: int,
    gpus: int | None = None,
    runtime_env: Mapping[str, Any],
    stop: threading.Event | None = None,
) -> RayCluster:
    """Attach to the cluster at `address`, or start a private one with `cpus` logical CPUs and
    `gpus` GPUs (None: those the host has). Once `stop` is set, KeyboardInterrupt is raised
    within `interrupt.POLL_S` (`ray.init`'s own wait aside), and nothing started is left running."""
    if address is not None:
        return attach(address, runtime_env=runtime_env, stop=stop)
    return start_private(cpus, gpus=gpus, runtime_env=runtime_env, stop=stop)


def attach(address: str, *, runtime_env: Mapping[str, Any], stop: threading.Event | None = None) -> RayCluster:
    """This process as a driver of the cluster at `address`; it starts no Ray process.

    Token authentication is Ray's own business here: the driver sends a token when this
    process's environment says so (`RAY_AUTH_MODE=token`, the token in `~/.ray/auth_token` or
    `RAY_AUTH_TOKEN`), as for any Ray driver. A cluster that refuses it is named at once.
    """
    import ray

    target = _keep_loopback(address)
    _check_reachable(address, target)
    _check_token(address, target)
    try:
        ray.init(address=target, **_driver_options(runtime_env))
    except Exception as exc:  # a refused token, a version mismatch, not a Ray GCS at all
        # Ray reports a refused driver as a failed connection: say what a token cluster needs.
        token = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
        hint = "" if token else "a cluster with token authentication also needs RAY_AUTH_MODE=token and its token here"
        raise RayUnreachable(address, exc, hint) from exc
    if stop is not None and stop.is_set():  # asked for while ray.init ran
        ray.shutdown()
    interrupt.check(stop)
    # ray.shutdown, for a driver of a cluster it did not start, only disconnects.
    return RayCluster(address=target, private=False, temp_dir=None, close=ray.shutdown)


def start_private(
    cpus: int, *, gpus: int | None = None, runtime_env: Mapping[str, Any], stop: threading.Event | None = None
) -> RayCluster:
    """A one-node cluster on loopback with token authentication on, and this process its driver.
    With `gpus=0` its processes are shown no GPU at all."""
    import ray

    _token_mode_for_this_process()
    temp_dir = Path(tempfile.mkdtemp(prefix="colocate-ray-"))  # short: Ray's socket paths must fit in 107 bytes
    reaper = start_reaper(temp_dir)
    try:
        address = _start_head(cpus, gpus, temp_dir, stop)
        ray.init(address=address, **_driver_options(runtime_env))
        interrupt.check(stop)
    except BaseException:
        with contextlib.suppress(Exception):
            ray.shutdown()  # if ray.init got that far
        stop_reaper(reaper, temp_dir)
        raise

    def close() -> None:
        try:
            ray.shutdown()
        finally:
            stop_reaper(reaper, temp_dir)

    return RayCluster(address=address, private=True, temp_dir=temp_dir, close=close)


def _driver_options(runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    return {"log_to_driver": False, "logging_level": logging.WARNING, "runtime_env": dict(runtime_env)}


def _keep_loopback(address: str) -> str:
    """`address` with a loopback host written so that ray.init keeps it (see `LOOPBACK_FOR_RAY`)."""
    host, _, port = address.rpartition(":")
    bare = host.strip("[]")
    with contextlib.suppress(ValueError):
        if bare == "localhost" or (ipaddress.ip_address(bare).version == 4 and ipaddress.ip_address(bare).is_loopback):
            return f"{LOOPBACK_FOR_RAY}:{port}"
    return address


def _check_reachable(address: str, target: str) -> None:
    """Fail at once, naming `address`, where nothing accepts a connection: ray.init itself would
    retry for minutes."""
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_S).close()
    except OSError as exc:
        raise RayUnreachable(address, exc) from exc


def _check_token(address: str, target: str) -> None:
    """Fail at once, naming `address`, where the cluster refuses this driver's token, or its lack
    of one: one call to its GCS, sending what a driver sends. ray.init would retry for half a
    minute, logging each refusal (InvalidAuthToken). Any other answer is left to ray.init."""
    import grpc
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # Cython: no stub
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    loader = AuthenticationTokenLoader.instance()
    metadata = tuple(loader.get_token_for_http_header().items()) if loader.has_token() else ()
    with grpc.insecure_channel(target) as channel:
        try:
            gcs = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # protobuf: no stub
            gcs.GetClusterId(request, timeout=REACH_S, metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAUTHENTICATED:
                return
            hint = (
                "the token this driver sends, from RAY_AUTH_TOKEN or ~/.ray/auth_token, is not the cluster's"
                if metadata
                else "a cluster with token authentication also needs RAY_AUTH_MODE=token and its token here"
            )
            raise RayUnreachable(address, PermissionError(exc.details()), hint) from None


_TOKEN_MODE = threading.Lock()


def _token_mode_for_this_process() -> None:
    """Put this process's Ray in token mode, once, for the life of the process.

    Ray reads its auth mode from `RAY_AUTH_MODE` into a configuration that is process-wide, and a
    driver not in token mode cannot talk to a cluster that is: there is no per-call setting.
    Ray's own `ray.init()` of a new local cluster does exactly this; ours is started by `ray
    start`, so it is done here. A user's explicit `RAY_AUTH_MODE=disabled` is refused
    rather than overridden: the private cluster does not run without authentication.
    """
    # What ray.init() calls for a new local cluster, less its warning, whose advice (set
    # RAY_AUTH_MODE=disabled) is the opposite of ours.
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    with _TOKEN_MODE:
        problems = auth_problems(os.environ.get("RAY_AUTH_MODE"))
        if problems:
            raise ConfigError(problems)
        if os.environ.get("RAY_AUTH_MODE") is None:
            _enable_token_auth()


def auth_problems(mode: str | None) -> list[str]:
    """Why an environment whose RAY_AUTH_MODE is `mode` cannot drive a private cluster (empty:
    it can); checked by `job.preflight`, before anything starts."""
    if mode is None or mode.lower() == "token":
        return []
    return [
        f"RAY_AUTH_MODE={mode} is set, and colocate's own Ray cluster keeps token authentication on: "
        "unset it, or start a cluster yourself and pass --ray-address"
    ]


def _ray_cli() -> list[str]:
    """The `ray` command of the Ray this process imports."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _start_head(cpus: int, gpus: int | None, temp_dir: Path, stop: threading.Event | None) -> str:
    """`ray start --head` on loopback; returns the address the driver connects to."""
    # The settings go to the Ray processes through their own environment and arguments, not this
    # process's: RAY_AUTH_MODE=token turns the token check on in every one of them, and
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray from replacing --node-ip-address 127.0.0.1
    # with the host's outward IP. With a loopback node IP, Ray binds its GCS, raylet, workers and
    # agents to loopback. The dashboard's UI, which would listen on a port of its own, is not
    # started; Ray's minimal dashboard head (usage stats only, which are off) listens on none.
    # MARK names the cluster in the environment of each of its processes (`head_processes`).
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", MARK: str(temp_dir)}
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_task_events_max_num_task_in_gcs", str(TASK_EVENTS_KEPT))
    if gpus == 0:  # the cluster's every process, its workers too, sees no GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    gpu_count = [] if gpus is None else [f"--num-gpus={gpus}"]
    # The token is Ray's own, in ~/.ray/auth_token; `ray start` wants one there already.
    _ray(["get-auth-token", "--generate"], env, stop)
    # `ray start` also serves Ray Client where its dependencies are installed, on 10001 unless
    # told otherwise (it cannot be turned off): a free port, so that two runs do not collide.
    from ray._private.utils import get_ray_client_dependency_error

    client = [] if get_ray_client_dependency_error() else [f"--ray-client-server-port={_free_port()}"]
    _ray(
        [
            "start",
            *client,
            "--head",
            f"--node-ip-address={LOOPBACK}",
            "--port=0",
            f"--num-cpus={cpus}",
            *gpu_count,  # none given: the GPUs this host shows the cluster
            "--include-dashboard=false",
            "--dashboard-agent-listen-port=0",
            "--metrics-export-port=0",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env,
        stop,
    )
    written = (temp_dir / "ray_current_cluster").read_text().strip()
    return f"{LOOPBACK_FOR_RAY}:{written.rpartition(':')[2]}"


def _free_port() -> int:
    with socket.create_server((LOOPBACK, 0)) as probe:
        return int(probe.getsockname()[1])


def _ray(args: list[str], env: Mapping[str, str], stop: threading.Event | None) -> None:
    """`ray ARGS`, in a session of its own, which the processes it starts inherit: a terminal's
    Ctrl-C, sent to the run's process group, reaches none of them (`ray start` would abort half
    way). Once `stop` is set, it is killed with what it started so far (KeyboardInterrupt)."""
    command = subprocess.Popen(
        [*_ray_cli(), *args], env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + HEAD_START_S
    while True:
        try:
            stdout, stderr = command.communicate(timeout=interrupt.POLL_S)
            break
        except subprocess.TimeoutExpired:
            late = time.monotonic() > deadline
            if late or (stop is not None and stop.is_set()):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(command.pid, signal.SIGKILL)  # and the daemons it started: its process group
                command.communicate()
                interrupt.check(stop)
                raise RuntimeError(f"`ray {args[0]}` did not end within {HEAD_START_S:g} s") from None
    if command.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"`ray {args[0]}` failed (exit {command.returncode}): " + " / ".join(tail))
