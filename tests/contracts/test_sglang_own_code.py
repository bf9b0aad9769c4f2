"""Every request colocate makes, judged by sglang 0.5.23's own code (the contract tier).

Runs only where sglang imports: `scripts/sglang-contract-tier.sh` makes that environment and runs
this file; elsewhere it is skipped. `tests/support/sglang_tier.py` says which of SGLang's code
runs (its HTTP app, request classes, sampling-param checks, the scheduler's weight-update manager
and flush) and what is replaced (the model runner, the ZMQ hop, the batches, torch_memory_saver).

colocate's own client, `SGLangGroup`, makes every request below, over HTTP, to SGLang's app.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed: the contract tier, scripts/sglang-contract-tier.sh", allow_module_level=True)

from orchestrator.adapters.engines.sglang import SGLangGroup
from orchestrator.core.config import EnginePause
from orchestrator.errors import EngineError
from states import EngineMemory
from tests.support import sglang_tier as tier
from tests.support.cli import ROOT

pytestmark = pytest.mark.timeout(120)

ALL = frozenset(EngineMemory)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder docs/sglang.md's first command writes: `colocate engine-config DIR`."""
    from typer.testing import CliRunner

    from orchestrator.cli.app import app

    folder = tmp_path_factory.mktemp("model")
    done = CliRunner().invoke(app, ["engine-config", str(folder), "--force"])  # in this process: see sglang_tier
    assert done.exit_code == 0, done.output
    return folder


@pytest.fixture
def served(model_folder: Path) -> Iterator[tier.Served]:
    with tier.sglang_app(model_folder) as s:
        yield s


@pytest.fixture
def group(served: tier.Served) -> Iterator[SGLangGroup]:
    g = SGLangGroup([served.url], flush_max_wait_s=1.0, flush_poll_s=0.05)
    yield g
    g.close()


def trainer_tensors(served: tier.Served) -> list[tuple[str, torch.Tensor]]:
    cfg = served.model_config.hf_config
    return [
        ("model.embed_tokens.weight", torch.randn(cfg.vocab_size, cfg.hidden_size).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(cfg.hidden_size)),  # fp32 beside bf16: offsets across widths
        ("lm_head.weight", torch.randn(cfg.vocab_size, cfg.hidden_size).to(torch.bfloat16)),
    ]


def routes(served: tier.Served) -> list[str]:
    return [route for route, _ in served.tokenizer.requests]


# ---- the model folder: SGLang's ServerArgs, ModelConfig and ModelRegistry --------------------------


def test_engine_config_folder_loads_with_sglangs_config_and_picks_llama(model_folder: Path) -> None:
    config = tier.ModelConfig.from_server_args(tier.server_args(model_folder))
    assert config.hf_config.architectures == ["LlamaForCausalLM"]
    assert config.hf_config.model_type == "llama" and config.dtype == torch.bfloat16
    assert tier.resolve_model_class(config).__name__ == "LlamaForCausalLM"


# ---- connect: /health, /server_info (version), /model_info -------------------------------------------


def test_connect_reads_sglangs_version_and_memory_saver(group: SGLangGroup, served: tier.Served) -> None:
    group.connect()
    info = group.engines[0].server_info()
    assert info["version"] == tier.VERSION == "0.5.23"
    assert info["enable_memory_saver"] is True and group.engines[0].tp_size == 1
    assert group.weight_version() is None  # SGLang reports "default" before any update


# ---- the update window: session, tensor buckets, flush ----------------------------------------------


def test_a_full_update_window_passes_sglangs_session_and_loads_every_tensor(
    group: SGLangGroup, served: tier.Served
) -> None:
    named = trainer_tensors(served)
    group.connect()
    group.release(ALL)
    group.resume(frozenset({EngineMemory.WEIGHTS}))
    with group.weight_update_session(1):
        group.update_weights(named[:2], version=1)
        group.update_weights(named[2:], version=1)
        group.flush_cache()
    group.resume(frozenset({EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH}))
    assert group.weight_version() == 1
    assert served.runner.sessions == ["begin", "end"]
    for name, tensor in named:  # SGLang's deserializer and FlattenedTensorBucket rebuilt each bit for bit
        assert torch.equal(served.runner.loaded[name], tensor), name
    assert served.scheduler.weight_versions == [None, None, "1"]  # the buckets', then the session's close


@pytest.mark.parametrize("path", ["in process", "by value", "fresh adapter"])
def test_the_version_moves_once_after_the_last_bucket_and_never_for_a_failed_update(
    group: SGLangGroup, served: tier.Served, path: str
) -> None:
    """The served version, after each request of an update, as SGLang's own request handling and
    scheduler record it. "by value": the buckets go through a copy of the engine, as the rank-0 Ray
    actor of a two-rank run gets it (a pickle round trip stands for Ray's). "fresh adapter": a new
    client meets a server an earlier one updated to version 7."""
    import pickle

    if path == "fresh adapter":
        with group.weight_update_session(7):
            group.update_weights(trainer_tensors(served), version=7)
        group = SGLangGroup([served.url])
    served.tokenizer.served.clear()
    old = served.tokenizer.weight_version
    sink = pickle.loads(pickle.dumps(group)) if path == "by value" else group
    lc = lifecycle_on(group, sink=sink)
    lc.pause_grads()
    lc.update_weights()
    version = str(group.weight_version())
    sent = [route for route, _ in served.tokenizer.served].count("/update_weights_from_tensor")
    assert sent >= 2  # one tensor per bucket
    buckets = [("/update_weights_from_tensor", old)] * sent
    assert served.tokenizer.served == [
        ("/begin_weight_update", old),
        *buckets,
        ("/end_weight_update", old),
        ("/update_weight_version", version),
    ]
    assert served.scheduler.weight_versions[-1] == version and version != old

    failing = lifecycle_on(group, sink=sink, fail_after_buckets=1)
    served.tokenizer.served.clear()
    failing.pause_grads()
    with pytest.raises(Exception, match="the trainer failed between buckets"):
        failing.update_weights()
    assert served.tokenizer.served == [
        ("/begin_weight_update", version),
        ("/update_weights_from_tensor", version),
        ("/end_weight_update", version),
    ]


def test_destroying_a_group_the_server_lacks_is_sglangs_false_not_an_error(group: SGLangGroup) -> None:
    assert group.engines[0].destroy_weights_update_group("colocate_weights") is False  # "does not exist"


def test_an_update_outside_the_session_is_refused_by_sglangs_scheduler(group: SGLangGroup, served: tier.Served) -> None:
    with pytest.raises(EngineError, match=r"must run between begin_weight_update\(\) and end_weight_update\(\)"):
        group.update_weights(trainer_tensors(served), version=1)
    engine = group.engines[0]
    with pytest.raises(EngineError, match=r"must run between begin_weight_update"):
        engine.update_weights_from_distributed(["lm_head.weight"], [torch.bfloat16], [(4, 4)], "colocate_weights", 1)


def test_a_failure_inside_the_session_still_closes_it(group: SGLangGroup, served: tier.Served) -> None:
    with pytest.raises(RuntimeError, match="the trainer failed"), group.weight_update_session():
        group.update_weights(trainer_tensors(served)[:1], version=1)
        raise RuntimeError("the trainer failed between buckets")
    assert served.runner.sessions == ["begin", "end"]
    with group.weight_update_session():  # SGLang opens a new one: the last one was closed
        pass
    assert served.runner.sessions == ["begin", "end", "begin", "end"]


def send(url: str, *args: str) -> list[str]:
    """The trainer's end of a broadcast (`WeightBroadcaster`), in a process of its own."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [sys.executable, "-m", "tests.support.broadcast_sender", url, "--port", port, "--timeout", "20", *args]


def test_the_broadcaster_joins_sends_and_tears_down_through_sglangs_own_group_code(served: tier.Served) -> None:
    """SGLang's model runner joins the group (`init_custom_process_group`), receives each bucket
    (`FlattenedTensorBucket.empty` and a gloo broadcast) and destroys the group; its app and
    scheduler record the version after every request. A trainer killed between updates leaves
    its group behind: the next one destroys it, and a second run goes on."""
    from tests.support.sglang_weights import tensors

    weight_routes = ("/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update")
    run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, timeout=120)
    done = run(send(served.url, "--versions", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    for name, tensor in tensors(seed=2):
        assert torch.equal(served.runner.loaded[name], tensor), name
    versions = [(r, v) for r, v in served.tokenizer.served if r in (*weight_routes, "/update_weight_version")]
    announce = [("/update_weights_from_distributed", "default")] * 3
    first = [("/begin_weight_update", "default"), *announce, ("/end_weight_update", "default")]
    assert versions[:5] == first and versions[5] == ("/update_weight_version", "1")
    assert versions[6:11] == [(r, "1") for r, _ in first] and versions[11:] == [("/update_weight_version", "2")]
    assert served.runner._model_update_group == {}  # destroyed by SGLang's own destroy at the close

    killed = subprocess.Popen([*send(served.url, "--versions", "1", "--first", "3"), "--hold"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert killed.stdout is not None and json.loads(killed.stdout.readline())["version"] == 3
    finally:
        killed.kill()
        killed.wait()
    assert list(served.runner._model_update_group) == ["colocate_weights"]  # left behind
    done = run(send(served.url, "--versions", "1", "--first", "4"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leftover" in done.stdout and served.tokenizer.weight_version == "4"
    assert served.runner._model_update_group == {}


def test_flush_while_busy_is_retried_until_sglang_flushes(group: SGLangGroup, served: tier.Served) -> None:
    served.scheduler.busy = 1
    with pytest.raises(EngineError, match=r"/flush_cache still refused after 1 s"):
        group.flush_cache()
    assert not group.is_idle()
    served.scheduler.busy = 0
    group.flush_cache()
    assert group.is_idle()


# ---- memory: SGLang's idle assertion and offload_tags ----------------------------------------------


def test_release_while_busy_is_refused_and_a_resume_of_what_is_not_released_is_never_sent(
    group: SGLangGroup, served: tier.Served
) -> None:
    """A resume of a tag SGLang has not released would raise in its `offload_tags.remove` (and end
    a real server: client.py): the client sends none, and `released()` follows SGLang's bookkeeping."""
    served.scheduler.busy = 1
    with pytest.raises(EngineError, match="should be called only when server is idle"):
        group.release(ALL)
    served.scheduler.busy = 0
    group.resume(frozenset({EngineMemory.KV_CACHE}))  # nothing released: a no-op, nothing sent
    assert "/resume_memory_occupation" not in routes(served)
    group.release(frozenset({EngineMemory.KV_CACHE}))
    assert group.released() == {EngineMemory.KV_CACHE} == served.tokenizer.manager.offload_tags
    group.release(ALL)  # kv_cache is not sent twice: torch_memory_saver would exit
    last = [o for route, o in served.tokenizer.requests if route == "/release_memory_occupation"][-1]
    assert sorted(last.tags) == ["cuda_graph", "weights"]
    group.resume(ALL)
    assert group.released() == frozenset() and not served.tokenizer.manager.offload_tags
    assert served.scheduler.busy == 0


# ---- rollout: SGLang's request normalization and SamplingParams --------------------------------------


def test_the_rollout_passes_sglangs_sampling_params_under_skip_tokenizer_init(
    group: SGLangGroup, served: tier.Served
) -> None:
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completions, logprobs = group.generate(prompts, max_new_tokens=4, temperature=1.0, seed=7)
    assert completions.shape == logprobs.shape == (2, 4)
    (obj,) = [o for route, o in served.tokenizer.requests if route == "/generate"]
    assert obj.return_logprob == [True, True] and [p["sampling_seed"] for p in obj.sampling_params] == [7, 8]


def test_sglang_itself_refuses_min_new_tokens_under_skip_tokenizer_init(group: SGLangGroup) -> None:
    """What colocate sent before: SGLang's SamplingParams.normalize(None) says no."""
    with pytest.raises(EngineError, match=r"min_new_tokens=4 is unavailable when skip_tokenizer_init=True"):
        group.engines[0].generate([[1, 2]], {"max_new_tokens": 4, "min_new_tokens": 4, "ignore_eos": True})


def test_pause_and_continue_parse_as_sglangs_requests(group: SGLangGroup, served: tier.Served) -> None:
    engine = group.engines[0]
    engine.pause_generation(EnginePause.RETRACT)
    assert served.tokenizer.paused == "retract"
    engine.continue_generation()
    assert served.tokenizer.paused is None


# ---- the lifecycle's update window, through SGLang's app -----------------------------------------


def lifecycle_on(group: SGLangGroup, *, sink: Any = None, fail_after_buckets: int | None = None) -> Any:
    """A real Lifecycle whose engine is colocate's SGLang client; its buckets go through `sink`
    (the group itself by default). The trainer side is the in-memory one (orchestrator/testing.py):
    what is judged here is the engine side, by SGLang."""
    from orchestrator import Lifecycle, LifecycleConfig
    from orchestrator.adapters.transport.bucketed import push_in_buckets
    from orchestrator.protocols import TransferReport
    from orchestrator.testing import InMemoryRegions, InMemoryTrainer
    from states import Mode, Region

    trainer = InMemoryTrainer()
    buckets_to = group if sink is None else sink

    class Transport:  # one bucket per tensor, into SGLang; optionally the trainer fails between them
        def push(self, version: int) -> TransferReport:
            named = list(trainer.sync_tensors())
            if fail_after_buckets is not None:
                for pair in named[:fail_after_buckets]:
                    buckets_to.update_weights([pair], version)
                raise RuntimeError("the trainer failed between buckets")
            return push_in_buckets(named, buckets_to, version, bucket_bytes=1)

    return Lifecycle(
        config=LifecycleConfig(mode=Mode.REMATERIALIZE),
        trainer=trainer,
        regions=InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop}),
        engine=group,
        transport=Transport(),
    )


def test_the_lifecycles_update_window_passes_sglangs_session_checks(group: SGLangGroup, served: tier.Served) -> None:
    group.connect()
    lc = lifecycle_on(group)
    lc.pause_grads()
    lc.update_weights()
    assert group.weight_version() == 1 and served.runner.sessions == ["begin", "end"]
    route_list = routes(served)
    begin, end = route_list.index("/begin_weight_update"), route_list.index("/end_weight_update")
    buckets = len(served.runner.loaded)  # one tensor per bucket
    assert route_list[begin + 1 : end] == ["/update_weights_from_tensor"] * buckets + ["/flush_cache"]
    assert {"layer0.weight", "layer1.weight"} <= set(served.runner.loaded)


def test_a_failure_in_the_update_window_closes_the_session_and_faults(group: SGLangGroup, served: tier.Served) -> None:
    from orchestrator.errors import ActionFailed
    from states import Phase

    group.connect()
    lc = lifecycle_on(group, fail_after_buckets=1)
    lc.pause_grads()
    with pytest.raises(ActionFailed, match="the trainer failed between buckets"):
        lc.update_weights()
    assert lc.phase == Phase.FAULTED
    assert served.runner.sessions == ["begin", "end"]  # SGLang's session was closed all the same
