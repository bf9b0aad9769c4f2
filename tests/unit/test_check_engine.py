"""`colocate check`'s engine group against the SGLang stand-in (tests/support/sglang_server.py),
in this process: what replaces SGLang is the stand-in's answers to /server_info, /model_info and
/ready, in SGLang's shape (tests/contracts/test_check_sglang_own_code.py reads SGLang's own).
Each check is made to fail for its real reason; every row names its fix; nothing but GETs is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli.plan.options import PlanOptions
from orchestrator.job.check import Outcome, Row, SetUp
from orchestrator.job.check.engine import rows
from states import Offload
from tests.support.sglang_server import SGLangStandIn

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `colocate engine-config DIR` writes: the HF config of the job's `tiny` GPT."""
    from orchestrator.adapters.megatron.convert import hf_llama_config
    from orchestrator.job.check.trainer import job_model

    path = tmp_path_factory.mktemp("model")
    hf_llama_config(job_model("tiny")).save_pretrained(path)
    return path


@pytest.fixture
def server(folder: Path) -> Iterator[SGLangStandIn]:
    with SGLangStandIn() as s:
        s.state.model_path = str(folder)
        yield s


def checked(*urls: str, model: str = "tiny", **options: object) -> dict[str, Row]:
    setup = SetUp(plan=PlanOptions(model=model, **options).plan(), model=model, engines=urls)  # type: ignore[arg-type]
    return {row.check: row for row in rows(setup)}


def only_gets(server: SGLangStandIn) -> None:
    routes = [path for path, body in server.state.requests]
    assert routes == ["/server_info", "/model_info", "/ready"], routes


def test_a_server_as_docs_sglang_starts_it_passes_and_is_only_read(server: SGLangStandIn) -> None:
    found = checked(server.url)
    for name in ("reachable", "version", "memory saver", "memory fit", "served config", "paused", "layout"):
        assert found[name].outcome is Outcome.OK, found[name]
    assert found["released"].outcome is Outcome.SKIPPED and "offload_tags" in found["released"].read
    assert (
        found["weight-update group"].outcome is Outcome.SKIPPED
        and "colocate_weights" in found["weight-update group"].read
    )
    only_gets(server)


def test_no_engine_given_is_one_skipped_row_naming_the_option() -> None:
    setup = SetUp(plan=PlanOptions(model="tiny").plan(), model="tiny")
    (row,) = rows(setup)
    assert row.outcome is Outcome.SKIPPED and "no --engine given" in row.read and row.fix and "--engine URL" in row.fix


def test_an_unreachable_server_fails_naming_its_url_and_the_fix() -> None:
    found = checked("http://127.0.0.1:9")
    row = found["reachable"]
    assert row.outcome is Outcome.FAIL and row.read.startswith("http://127.0.0.1:9: ") and "unreachable" in row.read
    assert row.fix and "start the server" in row.fix
    assert "layout" not in found


def test_a_server_without_the_memory_saver_fails(server: SGLangStandIn) -> None:
    server.state.memory_saver = False
    row = checked(server.url)["memory saver"]
    assert row.outcome is Outcome.FAIL and "cannot release memory for the trainer" in row.read
    assert row.fix and "--enable-memory-saver" in row.fix


def test_an_sglang_outside_the_range_fails_naming_the_range(server: SGLangStandIn) -> None:
    server.sglang_version = "0.5.9"
    row = checked(server.url)["version"]
    assert row.outcome is Outcome.FAIL and "runs sglang 0.5.9; colocate supports sglang >=0.5.23, <0.6" in row.read
    assert row.fix == "install sglang >=0.5.23, <0.6 on the server"


def test_a_served_config_that_computes_otherwise_fails_naming_the_key(server: SGLangStandIn, tmp_path: Path) -> None:
    config = json.loads((Path(server.state.model_path or "") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-6}))
    server.state.model_path = str(tmp_path)
    row = checked(server.url)["served config"]
    assert row.outcome is Outcome.FAIL and "rms_norm_eps is 1e-06 there, 1e-05 in the trainer's model" in row.read
    assert row.fix and "engine-config" in row.fix


def test_a_model_path_this_machine_cannot_read_is_a_warning_saying_what_was_read(server: SGLangStandIn) -> None:
    server.state.model_path = "Qwen/Qwen3-4B"  # a hub id, as a server may be started on
    row = checked(server.url)["served config"]
    assert row.outcome is Outcome.WARN and "'Qwen/Qwen3-4B' is no folder" in row.read and row.fix


def test_a_paused_server_is_a_warning(server: SGLangStandIn) -> None:
    server.state.paused = "retract"
    row = checked(server.url)["paused"]
    assert row.outcome is Outcome.WARN and "/ready answers 503" in row.read and row.fix


def test_a_kv_pool_that_leaves_no_room_for_what_the_trainer_keeps_fails_with_the_fraction_that_fits(
    server: SGLangStandIn,
) -> None:
    """Planned at mem_fraction_static 0.5 with both regions kept (`--offload never`, which fits);
    the server runs at 0.9, and its KV pool leaves no room for them."""
    server.state.mem_fraction_static = 0.9
    options = {"model": "qwen3-4b", "offload": Offload.NEVER, "mem_fraction_static": 0.5}
    assert PlanOptions(**options).plan()  # type: ignore[arg-type]
    row = checked(server.url, **options)["memory fit"]
    assert row.outcome is Outcome.FAIL and "mem_fraction_static 0.9 (the plan was given 0.5)" in row.read
    assert "offload never keeps" in row.read
    # The most that fits: the rollout holds the kept regions beside mem_fraction_static of the GPU.
    planned = PlanOptions(**options).plan()  # type: ignore[arg-type]
    rank = planned.ranks[0]
    kept = rank.grad_buffer + rank.optimizer_state + rank.frozen
    most = int((planned.engine.device_bytes - kept) / planned.engine.device_bytes * 100) / 100
    fix = f"restart the server with --mem-fraction-static {most:.2f} or lower (and no --max-total-tokens above it)"
    assert row.fix == fix


def test_servers_with_more_tp_ranks_than_the_trainer_has_fail_as_the_run_refuses(folder: Path) -> None:
    with SGLangStandIn(tp_size=2) as a, SGLangStandIn(tp_size=2) as b:
        row = checked(a.url, b.url, model="tiny", dp=2)["layout"]
    assert row.outcome is Outcome.FAIL and "the servers have 4 TP ranks (2 + 2), the trainer 2 ranks" in row.read
    assert "one trainer rank per TP rank" in row.read and row.fix


def test_a_server_wider_than_the_plans_engine_replica_is_a_warning(server: SGLangStandIn) -> None:
    server.state.tp_size = 2
    row = checked(server.url, model="tiny", dp=2)["layout"]
    assert row.outcome is Outcome.WARN and "another width than the plan's engine replica (1 GPUs)" in row.read
    assert row.fix and "--engine-gpus" in row.fix
