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


def send(*urls: str, versions: int = 2, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    port = free_port()  # a group name per call: this process's in-process stand-ins join each once
    command = [sys.executable, "-m", "tests.support.broadcast_sender", *urls, "--port", str(port)]
    command += ["--versions", str(versions), "--group", f"colocate_weights_{port}", "--timeout", str(timeout_s)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=80)


@pytest.fixture
def server() -> Iterator[SGLangStandIn]:
    with SGLangStandIn(weights=WEIGHTS, join_groups=True) as s:
        yield s


def test_the_server_receives_every_bucket_by_broadcast(server: SGLangStandIn) -> None:
    done = send(server.url)
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
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
