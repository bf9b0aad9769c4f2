"""A local stand-in for SGLang's HTTP server: its request schemas and documented behaviours, no model.

Not an SGLang engine. It checks what colocate sends against the request classes recorded in
`orchestrator/adapters/sglang_schema.json` (extracted from sglang's io_struct.py) and plays the
behaviours colocate relies on (sglang 0.5.23, design §4):

- unknown field → 400, missing required field → 400. SGLang itself *ignores* unknown fields
  (its pydantic schema uses `extra_behavior="ignore"`), so a misspelt `weight_verison` would be
  dropped silently there; the stand-in is stricter on purpose.
- /flush_cache answers 400 while requests are in flight (`hold`), 200 once they finish.
- release while requests are in flight fails (SGLang's scheduler asserts idle); resuming a tag
  that is not released fails (SGLang's `offload_tags.remove`).
- `weight_version` sent with an update is what /model_info reports afterwards ("default" before).
- /generate is refused before any weights arrived, and while weights or KV cache are released
  (SGLang would serve garbage: the stand-in flags it).
- /update_weights_from_tensor payloads are really deserialized: base64, then an unpickler limited
  to SGLang's own `SafeUnpickler.ALLOWED_GLOBALS` (recorded in the schema file). With CPU
  tensors, torch's ForkingPickler reductions share each storage through a file descriptor of
  shared memory (`rebuild_storage_fd` + `multiprocessing.resource_sharer.DupFd`, the default
  `file_descriptor` sharing strategy on Linux); the flattened bucket is then rebuilt as SGLang's
  `FlattenedTensorBucket.reconstruct_tensors` does, and names, shapes, dtypes and values recorded.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "orchestrator" / "adapters" / "sglang_schema.json"
TAGS = ("weights", "kv_cache", "cuda_graph")

# sglang's SafeUnpickler.ALLOWED_GLOBALS, as extracted from its common.py with the schema.
ALLOWED_GLOBALS = {tuple(pair) for pair in json.loads(SCHEMA_PATH.read_text())["safe_unpickler_allowed_globals"]}


class _Refused(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise _Refused(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return super().find_class(module, name)


def deserialize(data: str) -> Any:
    """SGLang's `MultiprocessingSerializer.deserialize` of a base64 string."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _Refused("Expected base64-encoded bytes") from exc
    return _SafeUnpickler(io.BytesIO(raw)).load()


def reconstruct(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """`FlattenedTensorBucket(flattened_tensor=..., metadata=...).reconstruct_tensors()`."""
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise _Refused(f"flattened_bucket payload must be {{flattened_tensor, metadata}}, got {type(payload).__name__}")
    flat = payload["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise _Refused("flattened_tensor must be a 1-D uint8 tensor")
    named: list[tuple[str, torch.Tensor]] = []
    for meta in payload["metadata"]:
        fields: dict[str, Any] = {
            f: getattr(meta, f, None) for f in ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
        }
        if any(v is None for v in fields.values()):
            raise _Refused(f"metadata entry lacks a FlattenedTensorMetadata field: {fields}")
        if fields["end_idx"] - fields["start_idx"] != fields["numel"]:
            raise _Refused(f"metadata of {fields['name']}: end_idx - start_idx != numel")
        view = flat[fields["start_idx"] : fields["end_idx"]].view(fields["dtype"]).reshape(fields["shape"])
        named.append((fields["name"], view.clone()))
    return named


@dataclass
class StandInState:
    """What the stand-in serves and received. Tests read and set it directly."""

    tp_size: int = 1
    weights: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None  # expected names; None = any
    in_flight: int = 0
    polls_until_idle: int = 0  # /flush_cache calls answered 400 before the held requests finish
    released: set[str] = field(default_factory=set)
    weight_version: str = "default"
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    buckets: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = field(default_factory=list)
    distributed: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    fail_next_update: str | None = None
    paused: str | None = None


class SGLangStandIn:
    """`with SGLangStandIn() as server: SGLangEngine(server.url)...`."""

    def __init__(self, *, tp_size: int = 1, weights: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None):
        schema = json.loads(SCHEMA_PATH.read_text())
        self.sglang_version: str = schema["sglang_version"]
        self.routes: dict[str, dict[str, Any]] = {c["route"]: c for c in schema["classes"].values()}
        self.state = StandInState(tp_size=tp_size, weights=weights)
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def hold(self, requests: int, polls: int) -> None:
        """`requests` in flight until `polls` more /flush_cache calls have been refused."""
        with self.lock:
            self.state.in_flight, self.state.polls_until_idle = requests, polls

    def __enter__(self) -> SGLangStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    # ---- validation ------------------------------------------------------------------------

    def validate(self, route: str, body: Any) -> None:
        if not isinstance(body, dict):
            raise _Refused(f"{route}: body must be a JSON object")
        fields = self.routes[route]["fields"]
        unknown = sorted(set(body) - set(fields))
        if unknown:
            raise _Refused(f"{route}: unknown field(s) {unknown} (sglang {self.sglang_version})")
        missing = sorted(name for name, spec in fields.items() if not spec["has_default"] and name not in body)
        if missing:
            raise _Refused(f"{route}: missing required field(s) {missing}")

    # ---- routes ----------------------------------------------------------------------------

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        route = path.split("?", 1)[0]
        with self.lock:
            self.state.requests.append((path, body))
            if route in self.routes:
                self.validate(route, body)
            handler = _ROUTES.get((method, route))
            if handler is None:
                return 404, {"detail": "Not Found"}
            return handler(self, self.state, body)


def _idle_required(state: StandInState, call: str) -> None:
    if state.in_flight:
        raise _Refused(f"{call} should be called only when server is idle ({state.in_flight} in flight)")


def _release(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    _idle_required(state, "release_memory_occupation")
    tags = body.get("tags") or list(TAGS)
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise _Refused(f"unknown memory tag(s) {unknown}")
    state.released |= set(tags)
    return 200, None


def _resume(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    tags = body.get("tags") or list(TAGS)
    not_released = sorted(set(tags) - state.released)
    if not_released:
        raise _Refused(f"KeyError: {not_released} not released")
    state.released -= set(tags)
    return 200, None


def _flush(server: SGLangStandIn, state: StandInState, body: Any) -> tuple[int, Any]:
    if state.in_flight:
        state.polls_until_idle -= 1
        if state.polls_until_idle <= 0:
            state.in_flight = 0
        return 400, "Flush cache failed: there are running or waiting requests.\n"
    return 200, "Cache flushed.\n"


def _update_from_tensor(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    if state.fail_next_update is not None:
        message, state.fail_next_update = state.fail_next_update, None
        return 400, {"success": False, "message": message}
    if "weights" in state.released:
        return 400, {"success": False, "message": "update while the weights are released"}
    payloads = body["serialized_named_tensors"]
    if not isinstance(payloads, list) or len(payloads) != state.tp_size:
        raise _Refused(f"serialized_named_tensors: one entry per TP rank ({state.tp_size}) expected")
    if body.get("load_format") != "flattened_bucket":
        raise _Refused("the stand-in checks load_format='flattened_bucket' payloads only")
    per_rank = [reconstruct(deserialize(p)) for p in payloads]  # every rank unpickles its own copy
    named = per_rank[0]
    for name, tensor in named:
        if state.weights is not None:
            expected = state.weights.get(name)
            if expected is None:
                return 400, {"success": False, "message": f"unknown weight name {name}"}
            if (tuple(tensor.shape), tensor.dtype) != expected:
                return 400, {"success": False, "message": f"{name}: {tuple(tensor.shape)} {tensor.dtype} != {expected}"}
        state.loaded[name] = tensor
    state.buckets.append([(n, tuple(t.shape), t.dtype) for n, t in named])
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Success"}


def _init_group(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def _update_from_distributed(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        return 400, {"success": False, "message": "names, dtypes and shapes differ in length"}
    bad = [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
    if bad:
        return 400, {"success": False, "message": f"unknown dtype(s) {bad}"}
    state.distributed.append(body)
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


def _generate(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    if not state.loaded and not state.distributed:
        return 400, {"error": {"message": "no weights were ever loaded: the output would be garbage"}}
    released = sorted(state.released & {"weights", "kv_cache"})
    if released:
        return 400, {"error": {"message": f"memory released: {released}"}}
    max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 4))
    results = []
    for prompt in body["input_ids"]:
        ids = [(sum(prompt) + i) % 97 for i in range(max_new)]
        meta = {
            "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(ids)],
            "finish_reason": {"type": "length", "length": max_new},
            "weight_version": state.weight_version,
        }
        results.append({"output_ids": ids, "meta_info": meta})
    return 200, results


def _pause(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    state.paused = body.get("mode", "abort")
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def _continue(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    state.paused = None
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


_ROUTES = {
    ("POST", "/release_memory_occupation"): _release,
    ("POST", "/resume_memory_occupation"): _resume,
    ("POST", "/flush_cache"): _flush,
    ("POST", "/update_weights_from_tensor"): _update_from_tensor,
    ("POST", "/init_weights_update_group"): _init_group,
    ("POST", "/update_weights_from_distributed"): _update_from_distributed,
    ("POST", "/generate"): _generate,
    ("POST", "/pause_generation"): _pause,
    ("POST", "/continue_generation"): _continue,
    ("GET", "/health"): lambda server, state, body: (200, None),
    ("GET", "/model_info"): lambda server, state, body: (200, {"weight_version": state.weight_version}),
    (
        "GET",
        "/v1/loads",
    ): lambda server, state, body: (
        200,
        {"loads": [{"dp_rank": 0, "num_running_reqs": state.in_flight, "num_waiting_reqs": 0}]},
    ),
}


def _handler(server: SGLangStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the engine's session expects

        def log_message(self, format: str, *args: Any) -> None:  # quiet test output
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
                status, content = server.handle(method, self.path, body)
            except _Refused as exc:
                status, content = exc.status, {"object": "error", "message": str(exc), "code": exc.status}
            except json.JSONDecodeError as exc:
                status, content = 400, {"object": "error", "message": f"invalid JSON: {exc}", "code": 400}
            text = content if isinstance(content, str) else json.dumps(content)
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(content, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler
