"""SGLangEngine against SGLang's request definitions, through a local stand-in server.

These tests check colocate's requests against SGLang's request definitions (the schema extracted
from sglang's io_struct.py, orchestrator/adapters/engines/sglang/sglang_schema.json) and its documented
behaviours, through a local stand-in server (tests/support/sglang_server.py). No SGLang engine
runs here: no model, no GPU, no CUDA IPC. The payloads are real (CPU tensors through the same
ForkingPickler + base64 format) and are unpickled and rebuilt by the stand-in.
"""

from __future__ import annotations

import json
import pickle
import re
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any
from unittest.mock import patch

import pytest
import torch

from orchestrator.adapters.engines.sglang import (
    Generation,
    SGLangEngine,
    SGLangGroup,
    flattened_bucket,
    serialize,
    url_problems,
)
from orchestrator.adapters.transport.bucketed import push_in_buckets
from orchestrator.core.config import EnginePause
from orchestrator.errors import ConfigError, EngineError
from orchestrator.protocols import RolloutEngine
from states import EngineMemory
from tests.support import sglang_server
from tests.support.sglang_server import SCHEMA_PATH, SGLangStandIn, reconstruct
from tests.support.sglang_weights import ALL, WEIGHTS, tensors

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def server() -> Iterator[SGLangStandIn]:
    with SGLangStandIn(weights=WEIGHTS) as s:
        yield s


@pytest.fixture
def engine(server: SGLangStandIn) -> Iterator[SGLangEngine]:
    e = SGLangEngine(server.url, flush_max_wait_s=2.0, flush_poll_s=0.01)
    yield e
    e.close()


def sent(server: SGLangStandIn, route: str) -> list[dict]:
    return [body for path, body in server.state.requests if path.split("?")[0] == route]


# ---- the schema and the requests -------------------------------------------------------------


def test_schema_is_sglang_05x_and_covers_every_route_sent() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema["sglang_version"].startswith("0.5.")
    tensor_req = schema["classes"]["UpdateWeightsFromTensorReqInput"]["fields"]
    assert not tensor_req["serialized_named_tensors"]["has_default"]
    assert {"load_format", "flush_cache", "weight_version"} <= set(tensor_req)
    generate = schema["classes"]["GenerateReqInput"]["fields"]
    assert {"input_ids", "sampling_params", "return_logprob"} <= set(generate)


def test_engine_is_a_rollout_engine_named_by_its_url(engine: SGLangEngine, server: SGLangStandIn) -> None:
    assert isinstance(engine, RolloutEngine)
    assert engine.name == server.url


def test_every_request_matches_its_sglang_class(engine: SGLangEngine, server: SGLangStandIn) -> None:
    engine.release(ALL)
    engine.resume(frozenset({EngineMemory.WEIGHTS}))
    with engine.weight_update_session(1):
        engine.update_weights(tensors(), version=1)
    engine.init_weights_update_group("127.0.0.1", 29500, rank_offset=1, world_size=2)
    with engine.weight_update_session(2):
        engine.update_weights_from_distributed(
            ["lm_head.weight"], [torch.bfloat16], [(32, 8)], "weight_update_group", 2
        )
    assert engine.destroy_weights_update_group("weight_update_group")
    engine.resume(frozenset({EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH}))
    for mode in ("retract", "abort", "in_place"):
        engine.pause_generation(EnginePause(mode))
        engine.continue_generation(EnginePause(mode))
    engine.generate([[1, 2, 3]], {"max_new_tokens": 2, "temperature": 1.0})
    # The stand-in answered 400 to any unknown or missing field: every call above passed validation.
    assert sent(server, "/release_memory_occupation") == [{"tags": ["cuda_graph", "kv_cache", "weights"]}]
    (update,) = sent(server, "/update_weights_from_tensor")
    assert update["load_format"] == "flattened_bucket"
    assert update["flush_cache"] is False and "weight_version" not in update  # the version moves at the close
    (dist,) = sent(server, "/update_weights_from_distributed")
    assert dist["dtypes"] == ["bfloat16"] and dist["shapes"] == [[32, 8]] and "weight_version" not in dist
    assert sent(server, "/update_weight_version") == [
        {"new_version": v, "abort_all_requests": False} for v in ("1", "2")
    ]
    assert sent(server, "/destroy_weights_update_group") == [{"group_name": "weight_update_group"}]
    assert [b["mode"] for b in sent(server, "/pause_generation")] == ["retract", "abort", "in_place"]
    assert sent(server, "/generate")[0]["return_logprob"] is True
    assert server.state.paused is None


@pytest.mark.parametrize(
    ("body", "fragment"),
    [({"tags": ["weights"], "tagz": []}, "unknown field(s) ['tagz']"), ({"load_format": "x"}, "missing required")],
)
def test_the_stand_in_refuses_what_sglangs_schema_does_not_define(
    engine: SGLangEngine, server: SGLangStandIn, body: dict, fragment: str
) -> None:
    route = "/release_memory_occupation" if "tags" in body else "/update_weights_from_tensor"
    with pytest.raises(EngineError, match="HTTP 400") as info:
        engine._call("POST", route, body)
    assert fragment in str(info.value)


def test_bucket_arrives_with_names_shapes_dtypes_and_values(engine: SGLangEngine, server: SGLangStandIn) -> None:
    named = tensors(seed=3)
    with engine.weight_update_session(7):
        sent_bytes = engine.update_weights(named, version=7)
    assert sent_bytes == sum(t.numel() * t.element_size() for _, t in named)
    assert sorted(server.state.buckets[0]) == sorted((n, tuple(t.shape), t.dtype) for n, t in named)
    assert len(server.state.buckets) == 1
    for name, tensor in named:
        assert torch.equal(server.state.loaded[name], tensor)
    assert engine.weight_version() == 7


def test_one_payload_per_tp_rank() -> None:
    with SGLangStandIn(tp_size=2, weights=WEIGHTS) as server:
        engine = SGLangEngine(server.url, tp_size=2)
        with engine.weight_update_session(1):
            engine.update_weights(tensors()[:2], version=1)
        assert len(sent(server, "/update_weights_from_tensor")[0]["serialized_named_tensors"]) == 2
        engine.close()


def test_flattened_bucket_offsets_are_bytes_across_dtypes() -> None:
    bucket = flattened_bucket(tensors())
    meta = bucket["metadata"]
    assert bucket["flattened_tensor"].dtype == torch.uint8
    assert meta[0].name == "model.norm.weight" and meta[0].dtype == torch.float32  # the widest first
    assert [(m.start_idx, m.end_idx) for m in meta] == [(0, 32), (32, 544), (544, 672), (672, 1184)]


def test_mixed_widths_of_odd_length_are_rebuilt_as_sglang_does() -> None:
    """An odd-length bf16 tensor before an fp32 one would put the fp32 at an offset SGLang's
    `view(dtype)` refuses; the bucket orders them so that every offset is aligned."""
    named = [
        ("b", torch.arange(3, dtype=torch.bfloat16)),
        ("f", torch.arange(2, dtype=torch.float32)),
        ("u", torch.arange(1, dtype=torch.uint8)),
        ("d", torch.arange(1, dtype=torch.float64)),
    ]
    rebuilt = dict(reconstruct(flattened_bucket(named)))
    for name, tensor in named:
        assert torch.equal(rebuilt[name], tensor) and rebuilt[name].dtype == tensor.dtype


# ---- documented behaviours -------------------------------------------------------------------


def test_flush_is_retried_while_requests_are_in_flight(engine: SGLangEngine, server: SGLangStandIn) -> None:
    server.hold(requests=2, polls=3)
    assert not engine.is_idle()
    engine.flush_cache()
    assert len(sent(server, "/flush_cache")) == 4  # three 400s, then 200
    assert engine.is_idle()


def test_flush_gives_up_after_its_bound_naming_the_engine(server: SGLangStandIn) -> None:
    engine = SGLangEngine(server.url, flush_max_wait_s=0.2, flush_poll_s=0.02)
    server.hold(requests=1, polls=10**6)
    start = time.monotonic()
    with pytest.raises(EngineError, match="still refused") as info:
        engine.flush_cache()
    assert time.monotonic() - start < 2
    assert info.value.engine == server.url
    engine.close()


def test_release_refused_while_busy(engine: SGLangEngine, server: SGLangStandIn) -> None:
    server.hold(requests=1, polls=1)
    with pytest.raises(EngineError, match="only when server is idle"):
        engine.release(ALL)


def test_unreachable_url_fails_fast_naming_it() -> None:
    engine = SGLangEngine("http://127.0.0.1:9", connect_timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(EngineError, match="unreachable") as info:
        engine.release(ALL)
    assert time.monotonic() - start < 30
    assert info.value.engine == "http://127.0.0.1:9" and "http://127.0.0.1:9" in str(info.value)
    assert not engine.health()
    with pytest.raises(EngineError, match="not ready"):
        engine.wait_until_ready(timeout_s=0.3, poll_s=0.1)


def test_success_false_raises_engine_error_with_the_message(engine: SGLangEngine, server: SGLangStandIn) -> None:
    server.state.fail_next_update = "Failed to load weights: shape mismatch"
    with pytest.raises(EngineError, match="shape mismatch") as info, engine.weight_update_session():
        engine.update_weights(tensors(), version=1)
    assert info.value.engine == server.url


def test_unknown_weight_name_is_reported(engine: SGLangEngine) -> None:
    with pytest.raises(EngineError, match=r"unknown weight name model\.bogus"), engine.weight_update_session():
        engine.update_weights([("model.bogus", torch.zeros(2))], version=1)


def test_generate_before_any_weights_is_refused(engine: SGLangEngine) -> None:
    assert engine.weight_version() is None
    with pytest.raises(EngineError, match="no weights"):
        engine.generate([[1, 2]], {"max_new_tokens": 2})


def test_lifecycle_sequence(engine: SGLangEngine, server: SGLangStandIn) -> None:
    engine.wait_until_ready(timeout_s=2)
    for version in (1, 2):
        assert engine.is_idle()
        engine.release(ALL)  # rollout done: hand the GPU to the trainer
        engine.resume(frozenset({EngineMemory.WEIGHTS}))  # trainer params still resident: weights only
        with pytest.raises(EngineError, match=r"released|no weights"):
            engine.generate([[1]], {"max_new_tokens": 1})
        with engine.weight_update_session(version):
            report = push_in_buckets(tensors(seed=version), engine, version, bucket_bytes=600)
        assert report.buckets == 3 and report.tensors == len(WEIGHTS)
        engine.resume(frozenset({EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH}))  # trainer params dropped
        engine.flush_cache()
        assert engine.weight_version() == version
        (out,) = engine.generate([[5, 6, 7]], {"max_new_tokens": 3, "temperature": 1.0})
        assert len(out.token_ids) == len(out.logprobs) == 3 and out.weight_version == str(version)
    for name, tensor in tensors(seed=2):
        assert torch.equal(server.state.loaded[name], tensor)
    assert len(server.state.buckets) == 6


def test_payload_globals_outside_sglangs_allowlist_are_refused(engine: SGLangEngine) -> None:
    payload = serialize({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": [Generation([], [])]})
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"}
    with (
        pytest.raises(
            EngineError, match=r"Blocked unsafe global \(orchestrator\.adapters\.engines\.sglang\.client\.Generation\)"
        ),
        engine.weight_update_session(),
    ):
        engine._call("POST", "/update_weights_from_tensor", body)


def test_an_engine_error_carries_the_http_status_through_a_pickle(engine: SGLangEngine) -> None:
    with pytest.raises(EngineError) as refused:
        engine._call("POST", "/no_such_route", {})
    assert refused.value.status == HTTPStatus.NOT_FOUND
    copy = pickle.loads(pickle.dumps(refused.value))  # as a Ray actor's error crosses processes
    assert (copy.engine, copy.reason, copy.status) == (engine.name, refused.value.reason, HTTPStatus.NOT_FOUND)
    with pytest.raises(EngineError) as unreachable:
        SGLangEngine("http://127.0.0.1:9", retries=0).server_info()
    assert unreachable.value.status is None  # no answer, so no status


def test_connect_names_a_server_without_server_info_by_its_404(
    server: SGLangStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sglang_server._ROUTES, ("GET", "/server_info"))
    with pytest.raises(EngineError, match=r"is this an SGLang 0\.5 server") as refused:
        SGLangGroup([server.url]).connect()
    assert refused.value.status == HTTPStatus.NOT_FOUND


# ---- several servers: SGLangGroup ----------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[SGLangStandIn, SGLangStandIn]]:
    with SGLangStandIn(weights=WEIGHTS) as a, SGLangStandIn(weights=WEIGHTS) as b:
        yield a, b


def test_group_fans_memory_weights_and_flushes_out_to_every_server(pair: tuple[SGLangStandIn, ...]) -> None:
    group = SGLangGroup([s.url for s in pair], flush_max_wait_s=2.0, flush_poll_s=0.01)
    assert isinstance(group, RolloutEngine) and group.name == f"sglang[{pair[0].url}, {pair[1].url}]"
    group.connect()
    group.release(ALL)
    group.resume(frozenset({EngineMemory.WEIGHTS}))
    with group.weight_update_session(1):
        sent_bytes = group.update_weights(tensors(), version=1)
    group.resume(frozenset({EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH}))
    pair[1].hold(requests=1, polls=2)  # one server still busy: the group's flush waits for it
    group.flush_cache()
    assert group.weight_version() == 1 and group.is_idle()
    for server in pair:
        assert not server.state.released and len(server.state.buckets) == 1
        assert [p for p, _ in server.state.requests].count("/flush_cache") >= 1
    assert sent_bytes == 2 * sum(t.numel() * t.element_size() for _, t in tensors())


def test_connect_takes_each_servers_tp_size_and_refuses_one_without_memory_saver() -> None:
    with SGLangStandIn(tp_size=2) as a, SGLangStandIn() as b:
        group = SGLangGroup([a.url, b.url])
        group.connect()
        assert [e.tp_size for e in group.engines] == [2, 1]
        with group.weight_update_session(1):
            group.update_weights(tensors(), version=1)  # two payloads to a, one to b: both accept
        b.state.memory_saver = False
        with pytest.raises(EngineError, match="--enable-memory-saver") as info:
            group.connect()
        assert info.value.engine == b.url


def test_group_refuses_servers_that_disagree_on_the_version(pair: tuple[SGLangStandIn, ...]) -> None:
    first = SGLangEngine(pair[0].url)
    with first.weight_update_session(3):
        first.update_weights(tensors(), version=3)
    group = SGLangGroup([s.url for s in pair])
    with pytest.raises(EngineError, match="different weight versions") as info:
        group.connect()
    assert pair[0].url in str(info.value) and pair[1].url in str(info.value)


def test_group_generate_splits_rows_in_order_with_a_seed_per_row(pair: tuple[SGLangStandIn, ...]) -> None:
    group = SGLangGroup([s.url for s in pair])
    with group.weight_update_session(1):
        group.update_weights(tensors(), version=1)
    prompts = torch.arange(15).reshape(5, 3)
    completions, logprobs = group.generate(prompts, max_new_tokens=4, temperature=1.0, seed=100)
    assert completions.shape == logprobs.shape == (5, 4)
    assert completions.dtype == torch.int64 and logprobs.dtype == torch.float32
    shares = [sent(server, "/generate")[0] for server in pair]
    assert [len(s["input_ids"]) for s in shares] == [3, 2]  # contiguous, the first takes the remainder
    assert shares[0]["input_ids"] + shares[1]["input_ids"] == prompts.tolist()
    params = shares[0]["sampling_params"] + shares[1]["sampling_params"]
    assert [p["sampling_seed"] for p in params] == [100, 101, 102, 103, 104]
    # ignore_eos alone gives full length: SGLang refuses min_new_tokens under --skip-tokenizer-init
    assert all(p["max_new_tokens"] == 4 and p["ignore_eos"] and "min_new_tokens" not in p for p in params)


def test_a_short_completion_is_an_engine_error(pair: tuple[SGLangStandIn, ...]) -> None:
    """SGLang ends a row early at a stop string or a length limit; the trainer's batch cannot take it."""
    group = SGLangGroup([pair[0].url])
    with group.weight_update_session(1):
        group.update_weights(tensors(), version=1)
    original = group.engines[0].generate
    group.engines[0].generate = (
        lambda ids, params: [  # type: ignore[method-assign]
            Generation(g.token_ids[:2], g.logprobs[:2]) for g in original(ids, params)
        ]
    )
    with pytest.raises(EngineError, match="not 4 tokens long"):
        group.generate(torch.ones(2, 3, dtype=torch.int64), max_new_tokens=4, temperature=1.0, seed=0)


def test_sampling_params_are_checked_against_sglangs_fields(engine: SGLangEngine) -> None:
    with engine.weight_update_session(1):
        engine.update_weights(tensors(), version=1)
    with pytest.raises(EngineError, match=r"unexpected keyword argument\(s\) \['max_tokens'\]"):
        engine.generate([[1, 2]], {"max_tokens": 2})  # the OpenAI name, not SGLang's


@pytest.mark.parametrize(
    ("urls", "problem"),
    [
        ([], "no SGLang server URL given"),
        (["127.0.0.1:30000"], "'127.0.0.1:30000': not an http:// or https:// URL"),
        (["http://"], "'http://': not an http:// or https:// URL"),
        (["http://a:1", "http://a:1/"], "server URL http://a:1 given twice"),
    ],
)
def test_bad_server_lists_are_config_errors(urls: list[str], problem: str) -> None:
    assert any(problem in p for p in url_problems(urls))
    with pytest.raises(ConfigError, match=re.escape(problem)):
        SGLangGroup(urls)


@pytest.fixture
def client_spans() -> Iterator[Any]:
    """The spans the engine's HTTP client makes, read back through the SDK's in-memory exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    exporter.tracer = provider.get_tracer("test")  # type: ignore[attr-defined]
    with patch("orchestrator.adapters.engines.sglang.http.trace.get_tracer", return_value=exporter.tracer):
        yield exporter
    provider.shutdown()


def test_actions_are_client_spans_and_every_request_carries_the_trace(
    engine: SGLangEngine, server: SGLangStandIn, client_spans: Any
) -> None:
    from opentelemetry.trace import StatusCode

    with client_spans.tracer.start_as_current_span("lifecycle.update_weights") as parent:
        engine.release(ALL)
        engine.weight_version()
    spans = client_spans.get_finished_spans()
    assert [s.name for s in spans] == ["POST /release_memory_occupation", "lifecycle.update_weights"]  # no GET
    host, port = server.url.removeprefix("http://").split(":")
    assert dict(spans[0].attributes or {}) == {  # OpenTelemetry's HTTP client conventions
        "server.address": host,
        "server.port": int(port),
        "url.full": f"{server.url}/release_memory_occupation",
        "url.template": "/release_memory_occupation",
        "http.request.method": "POST",
        "http.response.status_code": 200,
    }
    assert spans[0].status.status_code is StatusCode.UNSET  # a 2xx leaves it to the caller
    trace_id = f"{parent.get_span_context().trace_id:032x}"
    assert len(server.state.traceparents) == 2
    assert all(tp is not None and tp.split("-")[1] == trace_id for tp in server.state.traceparents)


def test_a_failed_call_is_an_error_span_with_its_error_type(
    engine: SGLangEngine, server: SGLangStandIn, client_spans: Any
) -> None:
    """The HTTP conventions' error rules: a 4xx answer (here SGLang's refusal of a bad request),
    a refused connection and SGLang's `success: false` each end the span as ERROR, with
    `error.type` the status code or the qualified name of the exception."""
    from opentelemetry.trace import StatusCode

    with pytest.raises(EngineError):
        engine._call("POST", "/release_memory_occupation", {"tags": ["kv_cache"], "no_such_field": 1})
    server.state.fail_next_update = "Failed to load bucket 1"
    with pytest.raises(EngineError):
        engine._call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "flush_cache": False})
    dead = SGLangEngine("http://127.0.0.1:9", flush_max_wait_s=0.1)  # the discard port: nothing listens
    with pytest.raises(EngineError):
        dead._call("POST", "/pause_generation", {"mode": "retract"})
    dead.close()
    spans = {s.name: s for s in client_spans.get_finished_spans()}
    assert all(s.status.status_code is StatusCode.ERROR for s in spans.values()), spans
    assert spans["POST /release_memory_occupation"].attributes["error.type"] == "400"
    assert spans["POST /release_memory_occupation"].attributes["http.response.status_code"] == 400
    assert spans["POST /update_weights_from_tensor"].attributes["error.type"] == "400"
    refused = spans["POST /pause_generation"]
    assert refused.attributes["error.type"] == "requests.exceptions.ConnectionError"
    assert "http.response.status_code" not in refused.attributes
    assert [e.name for e in refused.events] == ["exception"]


def test_a_refusal_in_a_200_body_is_an_error_span_too(client_spans: Any) -> None:
    """`success: false` under HTTP 200 (the stand-in answers refusals with 400, as SGLang does; a
    one-route server of the standard library answers this one): still a failed call, ERROR with
    `error.type` the exception colocate raised."""
    import http.server
    import threading

    from opentelemetry.trace import StatusCode

    class Refuses(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = b'{"success": false, "message": "not now"}'
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None: ...

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuses) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        engine = SGLangEngine(f"http://127.0.0.1:{httpd.server_address[1]}", flush_max_wait_s=0.1)
        with pytest.raises(EngineError, match="not now"):
            engine._call("POST", "/pause_generation", {"mode": "retract"})
        engine.close()
        httpd.shutdown()
    (span,) = client_spans.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.attributes["http.response.status_code"] == 200
    assert span.attributes["error.type"] == "orchestrator.errors.EngineError"


def test_with_tracing_off_no_request_carries_a_trace_context(engine: SGLangEngine, server: SGLangStandIn) -> None:
    """docs/sglang.md's condition: `traceparent` travels only while tracing is on (no span, no context)."""
    from opentelemetry import trace

    with patch("orchestrator.adapters.engines.sglang.http.trace.get_tracer", return_value=trace.NoOpTracer()):
        engine.release(ALL)  # an action
        engine.weight_version()  # a query
    assert server.state.traceparents == [None, None]


@pytest.mark.parametrize("version", ["0.5.22", "0.6.0", "0.4.9.post1", None])
def test_connect_refuses_an_sglang_outside_the_supported_range_naming_it(version: str | None) -> None:
    with SGLangStandIn() as server:
        server.sglang_version = version  # type: ignore[assignment]
        group = SGLangGroup([server.url])
        with pytest.raises(EngineError, match=re.escape("colocate supports sglang >=0.5.23, <0.6")) as info:
            group.connect()
        assert info.value.engine == server.url
        server.sglang_version = "0.5.23.post1"
        group.connect()


def test_the_group_session_closes_on_a_failure_and_opens_again(pair: tuple[SGLangStandIn, ...]) -> None:
    group = SGLangGroup([s.url for s in pair])
    with pytest.raises(RuntimeError, match="between buckets"), group.weight_update_session():
        assert all(s.state.session_open for s in pair)
        raise RuntimeError("the trainer failed between buckets")
    assert [s.state.session_open for s in pair] == [False, False] and [s.state.sessions for s in pair] == [1, 1]
    pair[1].state.session_open = True  # left open by a run that was killed mid-update: closed, opened anew
    with group.weight_update_session(1):
        group.update_weights(tensors(), version=1)
    assert [s.state.sessions for s in pair] == [2, 3] and [s.state.weight_version for s in pair] == ["1", "1"]
    pair[1].state.dead = "killed"  # a server that cannot open: the session the other one opened is closed
    unpaused = SGLangGroup([s.url for s in pair], pause="none")  # (a pause would meet the dead server first)
    with pytest.raises(EngineError, match=pair[1].url), unpaused.weight_update_session(2):
        pass
    assert not pair[0].state.session_open and pair[0].state.sessions == 3
    assert pair[0].state.weight_version == "1"


def test_serialize_sends_storages_by_name_from_threads_whatever_the_process_strategy() -> None:
    """Issue 12 item 8: serialization reads and sets no process-wide sharing strategy."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # torch's default on Linux
    buckets = [flattened_bucket(tensors(seed=i)) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        payloads = list(pool.map(serialize, buckets))
    for payload in payloads:
        raw = base64.b64decode(payload)
        assert b"rebuild_storage_filename" in raw and b"rebuild_storage_fd" not in raw
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"


def test_the_stand_in_refuses_min_new_tokens_as_sglang_does_under_skip_tokenizer_init(engine: SGLangEngine) -> None:
    with engine.weight_update_session(1):
        engine.update_weights(tensors(), version=1)
    with pytest.raises(EngineError, match=r"min_new_tokens=4 is unavailable when skip_tokenizer_init=True"):
        engine.generate([[1, 2]], {"max_new_tokens": 4, "min_new_tokens": 4, "ignore_eos": True})


def test_the_lifecycle_closes_the_session_when_the_update_fails_between_buckets_and_faults(
    server: SGLangStandIn,
) -> None:
    """The promise: a failure between /begin_weight_update and /end_weight_update still closes the
    session, and the lifecycle ends in FAULTED with the cause."""
    from orchestrator import Lifecycle, LifecycleConfig
    from orchestrator.errors import ActionFailed
    from orchestrator.protocols import TransferReport
    from orchestrator.testing import InMemoryRegions, InMemoryTrainer
    from states import Mode, Phase, Region

    group = SGLangGroup([server.url])
    trainer = InMemoryTrainer()

    class Transport:
        def push(self, version: int) -> TransferReport:
            assert server.state.session_open
            server.state.fail_next_update = "Failed to load weights: shape mismatch"
            group.update_weights(tensors(), version)
            raise AssertionError("unreachable: SGLang refused the bucket")

    lc = Lifecycle(
        config=LifecycleConfig(mode=Mode.REMATERIALIZE),
        trainer=trainer,
        regions=InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop}),
        engine=group,
        transport=Transport(),
    )
    lc.pause_grads()
    with pytest.raises(ActionFailed, match="shape mismatch"):
        lc.update_weights()
    assert lc.phase == Phase.FAULTED
    assert not server.state.session_open and server.state.sessions == 1
    assert [p for p, _ in server.state.requests].count("/end_weight_update") == 1


def test_a_shared_memory_manager_too_slow_to_answer_is_asked_again() -> None:
    """torch's libshm gives its manager one second per allocation; on two busy cores it can miss it
    (seen in CI: a push failed with this error). The share is asked again; other errors are not."""
    from orchestrator.adapters.engines.sglang.wire import patiently

    answers: list[object] = [RuntimeError("Shared memory manager connection has timed out")] * 2 + ["metadata"]

    def share() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert patiently(share) == "metadata" and answers == []
    always_slow = [RuntimeError("Shared memory manager connection has timed out")] * 5
    with pytest.raises(RuntimeError, match="timed out"):
        patiently(lambda: (_ for _ in ()).throw(always_slow.pop()))
    assert always_slow == [], "asked five times in all, then raised"
    with pytest.raises(RuntimeError, match="No space left"):
        patiently(lambda: (_ for _ in ()).throw(RuntimeError("No space left on device")))
