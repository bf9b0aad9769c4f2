"""Weight sync by broadcast, for SGLang servers off the trainer's GPUs, through stand-in servers.

The servers are the contract stand-in (tests/support/sglang_server.py) with `join_groups=True`:
they join the trainer's group and receive each bucket over gloo, as SGLang's
`init_custom_process_group` and `FlattenedTensorBucket.empty` do. The trainer's end
(`WeightBroadcaster`) runs in a process of its own. On a GPU the backend is NCCL; that, and
SGLang's own receiver, are not run here.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests
import torch

from tests.support.cli import ROOT
from tests.support.sglang_server import SGLangStandIn, tensor_checksum
from tests.support.sglang_weights import WEIGHTS, tensors

pytestmark = pytest.mark.timeout(90)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sender(*urls: str, versions: int = 2, timeout_s: float = 30) -> list[str]:
    """The trainer's end in a process of its own, under the group name `colocate run` uses."""
    command = [sys.executable, "-m", "tests.support.broadcast_sender", *urls, "--port", str(free_port())]
    return [*command, "--versions", str(versions), "--timeout", str(timeout_s)]


def send(*urls: str, versions: int = 2, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        sender(*urls, versions=versions, timeout_s=timeout_s), cwd=ROOT, capture_output=True, text=True, timeout=80
    )


@pytest.fixture
def server() -> Iterator[SGLangStandIn]:
    with SGLangStandIn(weights=WEIGHTS, join_groups=True) as s:
        yield s


def test_the_server_receives_every_bucket_by_broadcast(server: SGLangStandIn) -> None:
    done = send(server.url)
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["buckets"] for r in reports] == [3, 3]
    assert server.state.weight_version == "2" and len(server.state.buckets) == 6
    for name, tensor in tensors(seed=2):
        assert torch.equal(server.state.loaded[name], tensor), name
    (join,) = [body for path, body in server.state.requests if path == "/init_weights_update_group"]
    assert join["world_size"] == 2 and join["rank_offset"] == 1 and join["backend"] == "gloo"
    announced = [body for path, body in server.state.requests if path == "/update_weights_from_distributed"]
    assert all(a["load_format"] == "flattened_bucket" and a["flush_cache"] is False for a in announced)


def test_a_refused_announcement_fails_fast_naming_the_server(server: SGLangStandIn) -> None:
    server.state.fail_next_update = "Failed to update parameter online: shape mismatch"
    start = time.monotonic()
    done = send(server.url, versions=1, timeout_s=5)  # gloo's abandoned broadcast ends at the timeout
    assert done.returncode != 0 and time.monotonic() - start < 30
    assert server.url in done.stderr and "shape mismatch" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_two_servers_each_take_their_ranks_and_receive_everything() -> None:
    """Separate processes, as SGLang servers are: a process joins a group name once."""
    command = [sys.executable, "-m", "tests.support.sglang_server", "--join-groups"]
    procs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        urls = [p.stdout.readline().strip() if p.stdout is not None else "" for p in procs]
        done = send(*urls)
        assert done.returncode == 0, done.stderr
        expected = {name: tensor_checksum(t) for name, t in tensors(seed=2)}
        for url in urls:
            answer = requests.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=10).json()
            assert answer["ranks"][0]["checksums"] == expected
            assert requests.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "2"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_group_is_destroyed_at_close_and_a_second_run_joins_again(server: SGLangStandIn) -> None:
    for _ in range(2):  # the same servers, the same group name
        done = send(server.url, versions=1)
        assert done.returncode == 0, done.stderr[-2000:]
    assert server.state.destroyed == ["colocate_weights"] * 2 and not server.state.groups
    assert server.state.weight_version == "1"


def test_a_group_left_by_a_killed_trainer_is_destroyed_at_the_next_start(server: SGLangStandIn) -> None:
    killed = subprocess.Popen([*sender(server.url, versions=1), "--hold"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout is not None and json.loads(killed.stdout.readline())["version"] == 1
    finally:
        killed.kill()  # SIGKILL between updates: nothing closes the group
        killed.wait()
    assert list(server.state.groups) == ["colocate_weights"]
    done = send(server.url, versions=1)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leftover" in done.stdout and "a weight-update group named 'colocate_weights'" in done.stdout
    assert server.state.destroyed == ["colocate_weights"] * 2  # the leftover, then this run's own at its close


def test_a_refused_join_fails_the_start_at_once_with_sglangs_words(server: SGLangStandIn) -> None:
    """The server's process has a group of that name outside SGLang's registry, so the destroy
    finds none and torch refuses the join, after the rendezvous: the trainer must not wait out
    its group's timeout (30 s here) for a server that will never join."""
    from orchestrator.adapters.engines.sglang import weight_update_group

    squatter = weight_update_group(
        backend="gloo",
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=1,
        rank=0,
        group_name="colocate_weights",
        timeout_s=10,
    )
    try:
        start = time.monotonic()
        done = send(server.url, versions=1, timeout_s=30)
        took = time.monotonic() - start
    finally:
        torch.distributed.destroy_process_group(squatter)
    assert done.returncode != 0 and took < 20, (took, done.stderr[-2000:])
    assert server.url in done.stderr and "The specified group name has already been created" in done.stderr
