"""`colocate run --engine sglang` as a user runs it, against servers that speak SGLang's HTTP API.

No SGLang runs here (it needs a GPU and a CUDA torch). The servers are the contract stand-in
(tests/support/sglang_server.py) in processes of their own, started as docs/sglang.md starts
SGLang (on the folder `colocate engine-config` writes), each serving a real transformers Llama:
they check every request against SGLang's request classes, rebuild the weight buckets
from SGLang's wire format (shared-memory files here, CUDA IPC on a GPU), load them into the
model and sample from it. The CLI, the ranks, the lifecycle and `SGLangEngine` are the real ones.
What this cannot show is SGLang's own behaviour beyond what the stand-in reproduces.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.support.cli import CYCLE, ROOT, moved_once_at_the_end, run, served_versions, sglang_stand_ins
from tests.support.rewards import reward_rise, rise_needed
from tests.support.trace_check import read, whole

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    with sglang_stand_ins(tmp_path_factory.mktemp("model"), count=2) as urls:
        yield urls


def test_an_unreachable_server_fails_the_run_fast_naming_it() -> None:
    start = time.monotonic()
    done = run("run", "--engine", "sglang", "--engine-url", "http://127.0.0.1:9", timeout=60)
    assert done.returncode != 0
    assert time.monotonic() - start < 30
    assert "http://127.0.0.1:9" in done.stderr and "unreachable" in done.stderr, done.stderr


def test_server_lists_are_checked_before_anything_starts() -> None:
    done = run("run", "--engine", "sglang", "--engine-url", "localhost:30000", "--engine-url", "http://a:1")
    assert done.returncode == 2
    assert "--engine-url 'localhost:30000': not an http:// or https:// URL" in done.stderr
    done = run("run", "--engine-url", "http://a:1")
    assert done.returncode == 2 and "--engine-url is for --engine sglang" in done.stderr
    done = run("run", "--engine-pause", "abort")
    assert done.returncode == 2 and "--engine-pause abort is for --engine sglang" in done.stderr
    done = run("run", "--engine", "sglang", "--engine-url", "http://a:1", "--engine-pause", "hold")
    assert done.returncode == 2 and "'hold' is not one of" in done.stderr


def test_engine_config_writes_the_trained_models_llama_config_and_never_overwrites(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    from orchestrator.adapters.megatron.convert import hf_llama_config
    from orchestrator.job.grpo import GRPOConfig

    done = run("engine-config", str(tmp_path / "model"))
    assert done.returncode == 0 and "--load-format dummy" in done.stdout, done.stderr
    written = LlamaConfig.from_pretrained(tmp_path / "model").to_dict()
    expected = hf_llama_config(GRPOConfig().model).to_dict()
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "rope_parameters")
    assert {k: written[k] for k in keys} == {k: expected[k] for k in keys}
    raw = json.loads((tmp_path / "model" / "config.json").read_text())  # what SGLang picks the model class by
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert raw["torch_dtype"] == "bfloat16"
    before = (tmp_path / "model" / "config.json").read_text()
    done = run("engine-config", str(tmp_path / "model"))
    assert done.returncode == 1 and "exists; pass --force" in done.stderr
    assert (tmp_path / "model" / "config.json").read_text() == before


@pytest.mark.slow
def test_a_run_against_two_servers_learns_through_sglangs_wire_format(servers: list[str], tmp_path: Path) -> None:
    from orchestrator.job.presets import grpo_config  # what `colocate run` trains: --model tiny

    report_path, traces = tmp_path / "report.json", tmp_path / "traces"
    urls = [arg for url in servers for arg in ("--engine-url", url)]
    # Two ranks: each server's TP rank fed by the rank on its GPU (`PerTpRankPush`), from Ray actors.
    args = ["--steps", "6", "--ranks", "2", "--report", str(report_path), "--trace-dir", str(traces)]
    done = run("run", "--engine", "sglang", *urls, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    (trace_file,) = traces.glob("*.otlp.jsonl")
    assert whole(trace_file) == []  # the POSTs made in the push's threads and at the close included
    report = json.loads(report_path.read_text())
    steps = report["steps"]
    assert all(s["phases"] == CYCLE for s in steps)
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(set(versions)) and len(versions) == 6
    assert [s["restore_verified"] for s in steps[:2]] == [True, True]
    assert report["engine_matches_trainer"] is None  # SGLang cannot report its weights: not compared
    assert "not checked" in done.stdout
    for url in servers:  # both servers got every version, each once, after its update's last bucket
        assert requests.get(f"{url}/model_info", timeout=5).json()["weight_version"] == str(versions[-1])
        updates = served_versions(url)
        assert len(updates) == 6 and all(moved_once_at_the_end(u) for u in updates), updates
        assert (
            all(state == "default" for _, state in updates[0][:-1])
            and updates[0][1][0] == "/update_weights_from_tensor"
        )
    # The policy learns, so the weights arrive: the last 2 steps' mean reward is above the first 2's
    # by more than 6 standard deviations of what sampling alone moves it by (tests/support/rewards:
    # 0.033 at the run's 128 x 16 x 4 positions a step). Runs that learn rose 0.059-0.075 there; a
    # run that never gets its weights samples one policy throughout and stays within it.
    rewards = [s["reward_mean"] for s in steps]
    assert reward_rise(rewards, 2) > rise_needed(grpo_config("tiny"), 2), rewards


@pytest.mark.slow
def test_a_broadcast_run_that_fails_hands_its_servers_back_and_a_second_run_goes_on(tmp_path: Path) -> None:
    """--weight-sync broadcast: rank 0 hosts SGLang's weight-update group (gloo here, NCCL on GPUs).
    The third update fails on one server: the run stops, its group is
    destroyed on both servers, their memory is resident again, their generation stays paused, and
    they still serve version 2. A second run against them picks up from there."""
    with sglang_stand_ins(tmp_path / "model", count=2, join_groups=True) as urls:
        inject = {"fail_in_session": 3, "fail_at_bucket": 1}  # an update is one bucket here
        assert requests.post(f"{urls[0]}/_stand_in/inject", json=inject, timeout=5).status_code == 200
        servers = [arg for url in urls for arg in ("--engine-url", url)]
        args = ["run", "--engine", "sglang", *servers, "--weight-sync", "broadcast", "--ranks", "1"]
        failed = run(*args, "--steps", "6", "--trace-dir", str(tmp_path / "failed"))
        assert failed.returncode == 1 and "Failed to load bucket 1" in failed.stderr, failed.stdout + failed.stderr
        (trace_file,) = (tmp_path / "failed").glob("*.otlp.jsonl")
        assert whole(trace_file) == []  # the announcements' threads, the failed one's and the close's included
        for url in urls:
            state = requests.get(f"{url}/_stand_in/state", timeout=5).json()
            assert state["groups"] == [] and state["destroyed"] == ["colocate_weights"]
            assert state["released"] == [] and state["paused"] == "retract" and not state["session_open"]
            updates = served_versions(url)
            assert len(updates) == 3 and all(moved_once_at_the_end(u) for u in updates[:2])
            assert {v for _, v in updates[2]} == {"2"}, updates[2]  # the failed update: never served

        report_path = tmp_path / "report.json"
        again = run(*args, "--steps", "2", "--report", str(report_path), "--trace-dir", str(tmp_path / "again"))
        assert again.returncode == 0, again.stdout + again.stderr
        (trace_file,) = (tmp_path / "again").glob("*.otlp.jsonl")
        assert whole(trace_file) == []
        for url in urls:
            state = requests.get(f"{url}/_stand_in/state", timeout=5).json()
            assert state["destroyed"] == ["colocate_weights"] * 2 and state["groups"] == []
            assert state["paused"] is None
            assert all(moved_once_at_the_end(u) for u in served_versions(url)[3:])
            # The versions go on from the one the servers serve: never back, so never stale.
            assert requests.get(f"{url}/model_info", timeout=5).json()["weight_version"] == "4"
    steps = json.loads(report_path.read_text())["steps"]
    assert all(s["phases"] == CYCLE for s in steps)


def leave_a_group(url: str) -> None:
    """A trainer killed after joining the server's weight-update group: the group stays there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    command = [sys.executable, "-m", "tests.support.broadcast_sender", url, "--port", port, "--versions", "0"]
    killed = subprocess.Popen([*command, "--hold"], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while requests.get(f"{url}/_stand_in/state", timeout=5).json()["groups"] != ["colocate_weights"]:
            assert killed.poll() is None and time.monotonic() < deadline, "the sender left no group"
            time.sleep(0.2)
    finally:
        killed.kill()  # between updates: nothing closes the group
        killed.wait()


def leftover_lines(log: Path) -> list[dict[str, object]]:
    return [line for line in map(json.loads, log.read_text().splitlines()) if line["event"] == "leftover"]


@pytest.mark.slow
def test_a_leftover_group_found_in_rank_0s_process_reaches_the_log_and_stderr(tmp_path: Path) -> None:
    """--ranks 2: rank 0's Ray actor hosts the group and finds the one a killed run left. Its
    `leftover` warning is written to the driver's --log, with the process it came from and the
    ids of the rank's span it was written in, and to stderr."""
    log, traces = tmp_path / "log.jsonl", tmp_path / "traces"
    with sglang_stand_ins(tmp_path / "model", join_groups=True) as (url,):
        leave_a_group(url)
        args = ["--engine", "sglang", "--engine-url", url, "--weight-sync", "broadcast", "--ranks", "2"]
        done = run("run", *args, "--steps", "1", "--log", str(log), "--trace-dir", str(traces))
        assert done.returncode == 0, done.stdout + done.stderr
    (line,) = leftover_lines(log)
    assert line["process"] == "rank 0" and line["level"] == "warning" and line["component"] == url
    assert line["found"] == "a weight-update group named 'colocate_weights'" and line["done"] == "destroyed it"
    (trace_file,) = traces.glob("*.otlp.jsonl")
    (join,) = [s for s in read(trace_file) if s.name == "rank.join_weight_group"]
    assert (line["trace_id"], line["span_id"]) == (join.trace, join.id)
    assert "leftover" in done.stderr and "colocate_weights" in done.stderr


@pytest.mark.slow
def test_the_warning_of_a_call_that_fails_in_a_ranks_process_still_reaches_the_log(tmp_path: Path) -> None:
    """Rank 0 destroys the leftover group (a warning line), then the server refuses to join: the
    call fails, and its line still reaches the log and stderr."""
    log = tmp_path / "log.jsonl"
    with sglang_stand_ins(tmp_path / "model", join_groups=True) as (url,):
        leave_a_group(url)
        inject = {"fail_next_join": "the port is taken"}
        assert requests.post(f"{url}/_stand_in/inject", json=inject, timeout=5).status_code == 200
        args = ["--engine", "sglang", "--engine-url", url, "--weight-sync", "broadcast", "--ranks", "2"]
        done = run("run", *args, "--steps", "1", "--log", str(log))
    assert done.returncode == 1 and "the port is taken" in done.stderr, done.stdout + done.stderr
    (line,) = leftover_lines(log)
    assert line["process"] == "rank 0" and line["level"] == "warning" and line["done"] == "destroyed it"
    assert "leftover" in done.stderr


def test_broadcast_is_for_sglang() -> None:
    done = run("run", "--weight-sync", "broadcast")
    assert done.returncode == 2 and "--weight-sync broadcast is for --engine sglang" in done.stderr
