"""Where `colocate run`'s Ray comes from, run as a user runs it: the private cluster listens on
loopback only and its GCS keeps the events of a bounded number of tasks, a user's cluster is
attached to and left running, a bad address is named."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.job.ray_cluster import TASK_EVENTS_KEPT
from orchestrator.job.ray_reaper import head_processes
from tests.support import ray_head
from tests.support.cli import ROOT, colocate, run
from tests.support.ray_head import UsersCluster

pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow
TASK_EVENTS = "RAY_task_events_max_num_task_in_gcs"


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def processes(root: int | None, folder: Path) -> dict[int, str]:
    """pid → name of `root`, its descendants, and every process with `folder` on its command line
    or as its TMPDIR (the private cluster's daemons are not children of the run: `ray start`
    detaches them)."""
    found: dict[int, str] = {}
    if root is not None:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(root)
            found.update((p.pid, p.name()) for p in [proc, *proc.children(recursive=True)])
    for proc in psutil.process_iter(["cmdline", "name", "environ"]):
        with contextlib.suppress(psutil.Error):
            tmpdir = (proc.info["environ"] or {}).get("TMPDIR")
            if str(folder) in " ".join(proc.info["cmdline"] or []) or tmpdir == str(folder):
                found[proc.pid] = proc.info["name"]
                found.update((c.pid, c.name()) for c in proc.children(recursive=True))
    return found


def listeners(pids: dict[int, str]) -> list[tuple[str, int, str]]:
    return [
        (c.laddr.ip, c.laddr.port, pids[c.pid])
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]


def wait_for_step(proc: subprocess.Popen[str], log: Path, step: int, within: float = 300) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}): {proc.communicate()[1]}")
        with contextlib.suppress(OSError):
            if any(json.loads(line).get("step", 0) >= step for line in log.read_text().splitlines()):
                return
        time.sleep(0.2)
    raise AssertionError(f"step {step} did not start within {within} s")


@pytest.fixture
def temp() -> Iterator[Path]:
    """The run's TMPDIR, where a private cluster's folder goes: short, for Ray's socket paths
    must fit in 107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_private_run_listens_on_loopback_only(temp: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", TASK_EVENTS)}
    env["TMPDIR"] = str(temp)
    proc = subprocess.Popen(
        colocate("run", "--steps", "3", "--ranks", "2", "--log", str(log)),  # still going while step 2 is looked at
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_step(proc, log, 2)  # every rank, the engine and their gloo group are up
        # The driver holds still while its cluster is looked at: on a loaded machine the look
        # takes seconds, and the run's last step could end it, and its cluster, first.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            found = processes(proc.pid, temp)
            seen = listeners(found)
            kept = {
                psutil.Process(pid).environ().get(TASK_EVENTS) for pid, name in found.items() if name == "gcs_server"
            }
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        stdout, stderr = proc.communicate(timeout=300)
    names = {name for _, _, name in seen}
    print(f"{len(seen)} listening sockets:", sorted(seen))
    assert {"gcs_server", "raylet"} <= names, f"the run's Ray processes were not found: {names}"
    assert [s for s in seen if not is_loopback(s[0])] == []
    assert kept == {str(TASK_EVENTS_KEPT)}  # its GCS keeps the last 1,000 tasks' events, not Ray's 100,000
    assert proc.returncode == 0, stdout + stderr
    assert "Token authentication is enabled" not in stderr  # Ray's advice to turn it off is not shown
    # The private cluster went with the run: no process of it, no folder.
    assert [p for p in processes(None, temp) if p != os.getpid()] == []
    assert list(temp.glob("colocate-ray-*")) == []


def test_a_killed_run_leaves_no_cluster_behind(temp: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")} | {"TMPDIR": str(temp)}
    proc = subprocess.Popen(
        colocate("run", "--steps", "50", "--ranks", "2", "--log", str(log)),
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_step(proc, log, 1)
        (folder,) = temp.glob("colocate-ray-*")
        assert {"gcs_server", "raylet"} <= {p.name() for p in head_processes(folder)}
    finally:
        proc.kill()  # SIGKILL: the run has no chance to stop its cluster itself
        proc.wait()
    deadline = time.monotonic() + 60
    while ((left := head_processes(folder)) or folder.exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], [p.name() for p in left]
    assert not folder.exists()  # the reaper removes it last
    print(f"cluster gone {60 - (deadline - time.monotonic()):.1f} s after the kill")


@pytest.fixture
def users_cluster() -> Iterator[UsersCluster]:
    """A user's own cluster, started and stopped by this test (tests/support/ray_head.py)."""
    with ray_head.users_cluster("user-ray-") as cluster:
        yield cluster


def test_attach_runs_on_the_users_cluster_and_leaves_it_up(
    users_cluster: UsersCluster, temp: Path, tmp_path: Path
) -> None:
    cluster = users_cluster
    gcs = [pid for pid, name in processes(None, cluster.folder).items() if name == "gcs_server"]
    assert len(gcs) == 1
    report = tmp_path / "r.json"
    # A driver without the token is refused, and told why, at once: not after Ray's own retries,
    # each a warning line (20 over 24 s, before).
    without = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_MODE"} | {"TMPDIR": str(temp)}
    asked = time.monotonic()
    refused = subprocess.run(
        colocate("run", "--steps", "1", "--ray-address", cluster.address),
        cwd=ROOT, env=without, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    print(f"refused after {time.monotonic() - asked:.1f} s")
    message = " ".join(refused.stderr.split())
    assert refused.returncode == 1, refused.stderr
    assert f"cannot join the Ray cluster at {cluster.address}" in message and "RAY_AUTH_MODE=token" in message
    assert "gcs_client" not in message and message.count("InvalidAuthToken") == 1, refused.stderr
    # RAY_ADDRESS, as Ray's own tools take it; token mode, as any driver of that cluster needs.
    env = cluster.env | {"RAY_ADDRESS": cluster.address, "TMPDIR": str(temp)}
    # More ranks than its 4 CPUs hold (and the engine's bundle): refused once attached, before any actor.
    too_many = subprocess.run(
        colocate("run", "--steps", "1", "--ranks", "4", "--rank-timeout", "10"),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert too_many.returncode == 2, too_many.stderr
    assert (
        f"--ranks 4 needs 5 CPU(s) (a bundle of one CPU per rank, one for the engine), and the Ray cluster at "
        f"{cluster.address} has 4" in " ".join(too_many.stderr.split())
    ), too_many.stderr
    proc = subprocess.Popen(
        colocate("run", "--steps", "1", "--ranks", "2", "--report", str(report)),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    new_gcs: set[int] = set()
    while proc.poll() is None:  # no Ray of its own: no GCS among the run's processes, ever
        new_gcs |= {pid for pid, name in processes(proc.pid, temp).items() if name == "gcs_server"}
        time.sleep(0.5)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    assert new_gcs == set()
    assert list(temp.glob("colocate-ray-*")) == []
    assert json.loads(report.read_text())["steps"][-1]["restore_verified"] is True
    # The run's actors were the cluster's: its GCS remembers them, now dead, under the run's job.
    actors = cluster.ask(
        "print(json.dumps(sorted((a['ActorClassName'], a['State']) for a in ray._private.state.actors().values())))"
    )
    assert actors == [["EngineReplica", "DEAD"], ["TrainerRank", "DEAD"], ["TrainerRank", "DEAD"]]
    # And the cluster is still up: the same GCS, a live node with all its CPUs free again.
    assert psutil.pid_exists(gcs[0]) and psutil.Process(gcs[0]).status() != psutil.STATUS_ZOMBIE
    nodes = cluster.ask("print(json.dumps([n['Alive'] for n in ray.nodes()]))")
    assert nodes == [True]
    assert cluster.ask("print(json.dumps(ray.available_resources().get('CPU')))") == 4.0


def test_a_bad_or_unreachable_ray_address_is_named() -> None:
    done = run("run", "--steps", "1", "--ray-address", "head-node", timeout=120)
    assert done.returncode == 2
    assert "--ray-address 'head-node': expected HOST:PORT" in " ".join(done.stderr.split())
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port nothing accepts on once closed
        port = taken.getsockname()[1]
    start = time.monotonic()
    done = run("run", "--steps", "1", "--ray-address", f"127.0.0.1:{port}", timeout=120)
    assert done.returncode == 1
    assert f"cannot join the Ray cluster at 127.0.0.1:{port}" in " ".join(done.stderr.split()), done.stderr
    print(f"refused after {time.monotonic() - start:.1f} s")


def test_a_private_cluster_is_not_started_without_authentication(temp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    env["TMPDIR"] = str(temp)
    done = subprocess.run(
        colocate("run", "--steps", "1", "--ranks", "2"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr  # a configuration problem, found before anything starts
    assert "1 configuration problem(s)" in done.stderr
    assert "RAY_AUTH_MODE=disabled is set" in " ".join(done.stderr.split()), done.stderr
    assert list(temp.glob("colocate-ray-*")) == []
