"""`colocate check` run as a user runs it: on this machine (with no GPU the GPU rows are skipped,
never passed), its exit codes, the set-up it refuses, and a real `ray start` cluster's nodes
against the layout."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.cli import run
from tests.support.ray_head import users_cluster
from tests.support.spawn import free_port

GPU_ROWS = ("device memory per GPU", "torch_memory_saver (trainer)", "NVLink multicast")


def check(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, dict[str, str]]]:
    done = run("check", *args, "--json", env=env)
    assert done.returncode in (0, 1), done.stderr
    answer = json.loads(done.stdout)
    rows = {row["check"]: row for row in answer["rows"]}
    assert answer["ok"] == (done.returncode == 0) == all(r["outcome"] != "fail" for r in rows.values())
    return done.returncode, rows


def gpus() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_on_this_machine_the_gpu_rows_say_so_and_the_exit_is_the_verdicts() -> None:
    code, rows = check("qwen3-4b", "--tp", "2")
    if not gpus():
        for name in GPU_ROWS:
            assert rows[name]["outcome"] == "skipped" and rows[name]["read"].startswith("no GPU"), rows[name]
    assert {r["group"] for r in rows.values()} >= {"memory", "set-up", "runtime"}
    assert code == (1 if any(r["outcome"] == "fail" for r in rows.values()) else 0)
    table = run("check", "qwen3-4b", "--tp", "2")
    assert table.returncode == code and "skipped" in table.stdout and "colocate check" in table.stdout


def test_a_refused_set_up_fails_its_row_with_the_fix() -> None:
    code, rows = check("qwen3-4b", "--tp", "2", "--lora", "--overlap-param-gather")
    assert code == 1
    assert rows["no_lora"]["outcome"] == rows["no_overlap_param_gather"]["outcome"] == "fail"
    assert rows["no_lora"]["read"] == "rematerialize: LoRA base weights have no fp32 main to rebuild from"
    assert "--mode backup" in rows["no_lora"]["fix"]
    _, backup = check("qwen3-4b", "--tp", "2", "--lora", "--mode", "backup")
    setup = [r for r in backup.values() if r["group"] == "set-up"]  # LoRA is backup's to take
    assert [r["outcome"] for r in setup] == ["ok"] and "no_lora" not in setup[0]["read"], setup


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--tp", "3"), "do not divide by TP (3)"),
        (("--no-distributed-optimizer",), "rematerialize needs the distributed optimizer"),
        (("--gpus-per-node", "0"), "--gpus-per-node must be >= 1"),
    ],
)
def test_bad_input_exits_2_naming_it(args: tuple[str, ...], said: str) -> None:
    done = run("check", "qwen3-4b", *args)
    assert done.returncode == 2 and said in done.stderr, done.stderr


@pytest.fixture
def cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """A user's `ray start --head` of 2 logical GPUs, started and stopped by this test
    (tests/support/ray_head.py)."""
    pytest.importorskip("ray")
    with users_cluster("chk-ray-", gpus=2) as head:
        yield head.address, head.env


@pytest.mark.slow
def test_a_real_ray_cluster_s_nodes_against_the_layout(cluster: tuple[str, dict[str, str]]) -> None:
    address, env = cluster
    _, rows = check("qwen3-4b", "--tp", "2", "--ray-address", address, env=env)
    ray = rows["Ray cluster"]
    assert ray["outcome"] == "ok" and "1 node(s) (2 GPU, 4 CPU)" in ray["read"], ray
    _, rows = check("qwen3-4b", "--tp", "2", "--dp", "2", "--ray-address", address, env=env)
    ray = rows["Ray cluster"]
    assert ray["outcome"] == "fail", ray
    assert "needs 4 GPU(s) (a GPU per rank)" in ray["read"] and "0 node(s) have 4 GPUs" in ray["read"]
    assert "ray start --address" in ray["fix"]
    _, rows = check("qwen3-4b", "--tp", "2", "--ray-address", f"127.0.0.1:{free_port()}", env=env)
    assert rows["Ray cluster"]["outcome"] == "fail"  # nothing there: named, not hung on
