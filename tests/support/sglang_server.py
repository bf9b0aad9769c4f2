"""A local stand-in for SGLang's HTTP server: its request schemas and documented behaviours.

Not an SGLang engine. It checks what colocate sends against the request classes recorded in
`orchestrator/adapters/engines/sglang/sglang_schema.json` (extracted from sglang's io_struct.py) and plays the
behaviours colocate relies on (sglang 0.5.23's source, docs/sglang.md):

- unknown field → 400, missing required field → 400. SGLang itself *ignores* unknown fields
  (its pydantic schema uses `extra_behavior="ignore"`), so a misspelt `weight_verison` would be
  dropped silently there; the stand-in is stricter on purpose.
- /flush_cache answers 400 while requests are in flight (`hold`), 200 once they finish.
- release while requests are in flight fails (SGLang's scheduler asserts idle).
- a release of a released tag, or a resume of a tag that is not released, ends the server, as in
  SGLang (torch_memory_saver's `exit(1)` on a double pause; the scheduler's `KeyError` from
  `offload_tags.remove`, which ends its process: see client.py): `state.dead` says why, and every
  later request gets its connection closed unanswered.
- `state.fault` plays a memory call whose answer is lost, for the next release or resume:
  ("late", s) applies it and answers s seconds later; ("stall", s) holds the server s seconds
  before applying it (SGLang's scheduler handles one request at a time: a later request waits),
  then answers; ("drop", 0) applies it and closes the connection unanswered.
- `weight_version` sent with a successful update is what /model_info reports afterwards ("default"
  before); an update without one leaves it unchanged, as SGLang's `TokenizerControlMixin`
  (tokenizer_control_mixin.py: `update_weights_from_tensor`, `update_weights_from_distributed`) sets
  it only when the update succeeded and `weight_version` is not None. /update_weight_version sets
  it whatever it was (and aborts every request unless `abort_all_requests` is false).
  `state.versions` records, after every weight-update request, the version served then.
- `state.fail_at_bucket = n` fails the n-th update of the next session (an update that fails halfway).
- Weight updates only inside a session, as 0.5.23's `SchedulerWeightUpdaterManager` requires:
  /update_weights_from_tensor and /update_weights_from_distributed between /begin_weight_update
  and /end_weight_update; opening an open session or closing a closed one fails.
- `min_new_tokens` is refused, as SGLang's `SamplingParams.normalize(None)` refuses it on a server
  started with `--skip-tokenizer-init` (which the stand-in plays): it needs the eos_token_id.
- /generate is refused before any weights arrived, and while weights or KV cache are released
  (SGLang would serve garbage: the stand-in flags it).
- /update_weights_from_tensor payloads are really deserialized: base64, then an unpickler limited
  to SGLang's own `SafeUnpickler.ALLOWED_GLOBALS` (recorded in the schema file). CPU tensors
  arrive as shared-memory files named in the payload (`rebuild_storage_filename`), so any
  process can open them; the flattened bucket is then rebuilt as SGLang's
  `FlattenedTensorBucket.reconstruct_tensors` does, and names, shapes, dtypes and values recorded.
  CUDA tensors travel as CUDA IPC handles whose device is a UUID, mapped back to a local device
  index as SGLang's patched `rebuild_cuda_tensor` does.
  Where each payload's memory lives (the process that shared it, or the GPU) is recorded per
  bucket in `state.payload_origins` (`payload_origin`).
- `sampling_params` keys are checked against SGLang's `SamplingParams` fields: SGLang builds
  `SamplingParams(**sampling_params)`, which refuses any other.
- Weight-update groups by name, as SGLang's model runner keeps them: /init_weights_update_group
  refuses a name the server has, with torch's words ("The specified group name has already been
  created"), and /destroy_weights_update_group of a name it has none of with SGLang's ("The group
  to be destroyed does not exist."). With `join_groups=True`, the init really joins the trainer's
  group (as one TP rank: a rendezvous first, then torch's check, as SGLang's
  `init_custom_process_group` does) and /update_weights_from_distributed really receives the
  broadcast, laid out as SGLang's `FlattenedTensorBucket.empty` lays it out (refusing an unaligned
  offset, as it does). Otherwise the announcements are only recorded.
- /pause_generation's modes: `abort` drops the requests in flight; `retract` requeues them, and a
  flush or release then ignores them (SGLang's `is_fully_idle(ignore_waiting=...)` while paused);
  `in_place` keeps them. /generate while paused is refused (SGLang would hold it until
  /continue_generation). /abort_request {abort_all} drops every request in flight;
  `state.aborts_needed` makes them outlast that many aborts, as /v1/loads may lag them.
- /server_info reports `tp_size`, `enable_memory_saver`, `mem_fraction_static` and the other
  `ServerArgs` fields listed in `_server_info`; /model_info its `model_path` (the folder given
  with `--model-path`); /ready answers 503 while paused, as SGLang's does; /weights_checker's `checksum` hashes
  what was loaded as SGLang hashes CPU tensors.

GET /_stand_in/state and POST /_stand_in/inject (no SGLang routes) let a test read what a
stand-in in a process of its own recorded, and set its failures.

By default it has no model: /generate answers with made-up tokens. Given a `TransformersEngine`
(`model=`, or `--model-path` when run as a process), it is a server that really serves: the
weights it receives are loaded into that model, memory calls release and resume it, and /generate
samples from it. That is what `colocate run --engine sglang` is tested against on machines
without SGLang, started as SGLang would be:

    colocate engine-config DIR
    python -m tests.support.sglang_server --model-path DIR [--device cuda]   # prints its URL
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import io
import json
import os
import pickle
import re
import sys
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing import reductions

from states import EngineMemory

SCHEMA_PATH = (
    Path(__file__).resolve().parents[2] / "orchestrator" / "adapters" / "engines" / "sglang" / "sglang_schema.json"
)
TAGS = ("weights", "kv_cache", "cuda_graph")

# sglang's SafeUnpickler.ALLOWED_GLOBALS, as extracted from its common.py with the schema.
ALLOWED_GLOBALS = {tuple(pair) for pair in json.loads(SCHEMA_PATH.read_text())["safe_unpickler_allowed_globals"]}
SAMPLING_FIELDS = frozenset(json.loads(SCHEMA_PATH.read_text())["sampling_params_fields"])
_CUDA_DEVICE_ARG = 6  # `device` in torch's rebuild_cuda_tensor args: a UUID on SGLang's wire


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise _Refused(f"no local CUDA device has UUID {uuid}")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """SGLang's patch: the sender put the device UUID where torch puts the device index."""
    from torch.multiprocessing import reductions

    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        args = (*args[:_CUDA_DEVICE_ARG], _device_index(device), *args[_CUDA_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


class _Died(Exception):
    """The server ended: the connection closes unanswered."""


_MEMORY_ROUTES = ("/release_memory_occupation", "/resume_memory_occupation")
_VERSIONED_ROUTES = (
    "/begin_weight_update",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/end_weight_update",
    "/update_weight_version",
)


class _Refused(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise _Refused(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return _rebuild_storage_filename
        return super().find_class(module, name)


def _rebuild_storage_filename(cls: Any, manager: bytes, handle: bytes, size: int, dtype: Any = None) -> Any:
    """torch's `rebuild_storage_filename`, except for memory another process shared: that is
    copied from its file under /dev/shm, and this process never connects to that process's
    torch_shm_manager. libshm allocates through the first manager a process connected to (its
    `managers.begin()`), so once that other process and its manager are gone, this process could
    share nothing again ("Broken pipe"), and a test process hosts stand-ins and later sends
    buckets itself. The reference the sender took for the receiver is left to its manager, which
    unlinks the file when that process ends. (SGLang, a process of its own, uses torch's.)"""
    creator = _SHM_CREATOR.match(handle)
    if creator is None or int(creator.group(1)) == os.getpid():
        return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)
    nbytes = size if dtype is None else size * torch._utils._element_size(dtype)
    path = Path("/dev/shm") / handle.decode().lstrip("/")
    header = path.stat().st_size - nbytes  # libshm's refcount block (64 bytes), then the data
    with path.open("rb") as file:
        file.seek(header)
        data = bytearray(file.read(nbytes))
    storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if data else torch.UntypedStorage(0)
    return storage if dtype is None else torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def deserialize(data: str) -> Any:
    """SGLang's `MultiprocessingSerializer.deserialize` of a base64 string."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _Refused("Expected base64-encoded bytes") from exc
    return _SafeUnpickler(io.BytesIO(raw)).load()


_REDUCTIONS = "torch.multiprocessing.reductions"
_SHM_CREATOR = re.compile(rb"/torch_(\d+)_")  # torch's shared-memory file name: /torch_<creator pid>_<random>_<n>


def payload_origin(data: str) -> str:
    """Where one /update_weights_from_tensor payload's memory lives, read from the payload alone:
    its pickle is walked with torch's rebuild functions replaced by a recorder, so nothing is
    mapped and no shared-memory or CUDA IPC refcount moves.

    - A CPU storage travels by shared-memory file name (`rebuild_storage_filename`'s `handle`),
      which torch makes `/torch_<pid>_<random>_<n>`, pid being the process that shared it: "pid <pid>".
    - A CUDA tensor travels by IPC handle (`rebuild_cuda_tensor`); its `device` argument is the
      device UUID on SGLang's wire: "cuda <uuid>". (Not run here: no GPU.)

    Several storages in one payload: their origins, sorted, joined by ", "."""
    origins: set[str] = set()

    def recorder(name: str) -> Any:
        def record(*args: Any) -> None:
            if name == "rebuild_storage_filename":
                creator = _SHM_CREATOR.match(args[2])
                origins.add(f"pid {creator.group(1).decode()}" if creator else f"file {args[2]!r}")
            elif name == "rebuild_cuda_tensor":
                origins.add(f"cuda {args[_CUDA_DEVICE_ARG]}")

        return record

    class Reader(_SafeUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = super().find_class(module, name)  # what SGLang would refuse is refused here too
            return recorder(name) if module == _REDUCTIONS else found

    Reader(io.BytesIO(base64.b64decode(data))).load()
    return ", ".join(sorted(origins))


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
    payload_origins: list[list[str]] = field(default_factory=list)  # per bucket, per TP rank: `payload_origin`
    distributed: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    traceparents: list[str | None] = field(default_factory=list)  # one per request
    fail_next_update: str | None = None
    fail_next_join: str | None = None  # the next /init_weights_update_group is refused with these words
    paused: str | None = None
    model: Any = None  # a TransformersEngine that serves, or None (made-up tokens)
    join_groups: bool = False
    memory_saver: bool = True  # what /server_info reports as enable_memory_saver
    mem_fraction_static: float = 0.8  # ... and as mem_fraction_static (SGLang's default is its own choice)
    model_path: str | None = None  # the folder it was started on (--model-path), as /model_info reports it
    groups: dict[str, Any] = field(default_factory=dict)  # weight-update groups joined
    skip_tokenizer_init: bool = True  # started as docs/sglang.md starts SGLang
    session_open: bool = False  # between /begin_weight_update and /end_weight_update
    sessions: int = 0  # sessions closed
    fault: tuple[str, float] | None = None  # the next memory call's lost answer (see the module docstring)
    dead: str | None = None  # why the server ended, as SGLang's would
    fail_at_bucket: int | None = None  # the session's n-th weight update (1-based) fails, as fail_next_update
    fail_in_session: int | None = None  # ... in the session of this number (1-based); None: the next one
    session_buckets: int = 0  # weight updates taken in the open session
    # (route, the version served after it): every weight-update request, in order, as SGLang records them
    versions: list[tuple[str, str]] = field(default_factory=list)
    destroyed: list[str] = field(default_factory=list)  # group names destroyed, in order
    aborts_needed: int = 1  # aborts (an abort pause, /abort_request) before the requests in flight end


class SGLangStandIn:
    """`with SGLangStandIn() as server: SGLangEngine(server.url)...`."""

    def __init__(
        self,
        *,
        tp_size: int = 1,
        weights: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        model: Any = None,
        port: int = 0,
        join_groups: bool = False,
    ):
        schema = json.loads(SCHEMA_PATH.read_text())
        self.sglang_version: str = schema["sglang_version"]
        self.routes: dict[str, dict[str, Any]] = {c["route"]: c for c in schema["classes"].values()}
        self.state = StandInState(tp_size=tp_size, weights=weights, model=model, join_groups=join_groups)
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
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
        for group in self.state.groups.values():  # a server's process ends with its groups
            if group is not None:
                torch.distributed.destroy_process_group(group)
        self.state.groups.clear()

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
        sampling = body.get("sampling_params") or {}
        for params in [sampling] if isinstance(sampling, dict) else sampling:
            unknown = sorted(set(params) - SAMPLING_FIELDS)
            if unknown:
                raise _Refused(f"SamplingParams.__init__() got unexpected keyword argument(s) {unknown}")
            if self.state.skip_tokenizer_init and params.get("min_new_tokens"):
                raise _Refused(
                    f"min_new_tokens={params['min_new_tokens']} is unavailable when skip_tokenizer_init=True "
                    "(requires tokenizer for eos_token_id)"
                )

    # ---- routes ----------------------------------------------------------------------------

    def handle(self, method: str, path: str, body: Any, traceparent: str | None = None) -> tuple[int, Any]:
        """The answer; raises `_Died` where the connection must close unanswered. A fault's late
        answer is slept out after the lock is let go (the server goes on serving meanwhile)."""
        route = path.split("?", 1)[0]
        with self.lock:
            if self.state.dead is not None:
                raise _Died(self.state.dead)
            self.state.requests.append((path, body))
            self.state.traceparents.append(traceparent)
            fault = self.state.fault if route in _MEMORY_ROUTES else None
            if fault is not None:
                self.state.fault = None
                if fault[0] == "stall":
                    time.sleep(fault[1])  # the scheduler is busy with it: later requests wait
            if route in self.routes:
                self.validate(route, body)
            handler = _ROUTES.get((method, route))
            if handler is None:
                return 404, {"detail": "Not Found"}
            answer = handler(self, self.state, body)
            if route in _VERSIONED_ROUTES:
                self.state.versions.append((route, self.state.weight_version))
        if fault is not None and fault[0] == "drop":
            raise _Died("the connection dropped after the call was applied")
        if fault is not None and fault[0] == "late":
            time.sleep(fault[1])
        return answer


def _idle_required(state: StandInState, call: str) -> None:
    if state.in_flight and state.paused != "retract":
        raise _Refused(f"{call} should be called only when server is idle ({state.in_flight} in flight)")


def _release(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    _idle_required(state, "release_memory_occupation")
    tags = body.get("tags") or list(TAGS)
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise _Refused(f"unknown memory tag(s) {unknown}")
    if set(tags) & state.released:  # torch_memory_saver: "Cannot pause allocation that is not active"
        state.dead = f"double pause of {sorted(set(tags) & state.released)}: torch_memory_saver exit(1)"
        raise _Died(state.dead)
    if state.model is not None:
        state.model.release(frozenset(EngineMemory(t) for t in tags))
    state.released |= set(tags)
    return 200, None


def _resume(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    tags = body.get("tags") or list(TAGS)
    not_released = sorted(set(tags) - state.released)
    if not_released:  # offload_tags.remove raises in the scheduler's process, which ends the server
        state.dead = f"resume of {not_released}, not released: KeyError in the scheduler"
        raise _Died(state.dead)
    if state.model is not None:
        state.model.resume(frozenset(EngineMemory(t) for t in tags))
    state.released -= set(tags)
    return 200, None


def _flush(server: SGLangStandIn, state: StandInState, body: Any) -> tuple[int, Any]:
    if state.in_flight and state.paused != "retract":  # a retract pause requeued them: ignored, as SGLang does
        state.polls_until_idle -= 1
        if state.polls_until_idle <= 0:
            state.in_flight = 0
        return 400, "Flush cache failed: there are running or waiting requests.\n"
    if state.model is not None:
        state.model.flush_cache()
    return 200, "Cache flushed.\n"


def _session_required(state: StandInState, call: str) -> tuple[int, Any] | None:
    """SGLang's refusal outside a session; else None, and the injected failure of this bucket, if any."""
    if not state.session_open:
        return 400, {
            "success": False,
            "message": f"{call} must run between begin_weight_update() and end_weight_update()",
        }
    state.session_buckets += 1
    session = state.sessions + 1
    if state.session_buckets == state.fail_at_bucket and state.fail_in_session in (None, session):
        state.fail_at_bucket, state.fail_next_update = None, f"Failed to load bucket {state.session_buckets}"
    return None


def _begin(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    if state.session_open:
        return 400, {
            "success": False,
            "message": "a weight-update session is already open; call end_weight_update() first",
        }
    state.session_open, state.session_buckets = True, 0
    return 200, {"success": True, "message": "Success"}


def _end(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    if not state.session_open:
        return 400, {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
    state.session_open, state.sessions = False, state.sessions + 1
    return 200, {"success": True, "message": "Success"}


def _update_from_tensor(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    refused = _session_required(state, "update_weights_from_tensor")
    if refused:
        return refused
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
    state.payload_origins.append([payload_origin(p) for p in payloads])
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
    if state.model is not None:  # one loading tag per session: a bucket may carry no weight_version
        state.model.update_weights(named, state.sessions + 1)
    return 200, {"success": True, "message": "Success"}


def _init_group(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    """SGLang's model runner: `init_custom_process_group` (a rendezvous, then torch's
    `_new_process_group_helper`, which refuses a group name this process has); any failure is
    answered 400 with its words. Without `join_groups`, the name is only registered, and a name
    the server has is refused with torch's words, at once."""
    name = body["group_name"]
    if state.fail_next_join is not None:
        words, state.fail_next_join = state.fail_next_join, None
        return 400, {"success": False, "message": f"Failed to initialize custom process group: {words}."}
    try:
        if state.join_groups:
            from orchestrator.adapters.engines.sglang import weight_update_group

            state.groups[name] = weight_update_group(
                backend=body.get("backend", "nccl"),
                master_address=body["master_address"],
                master_port=body["master_port"],
                world_size=body["world_size"],
                rank=body["rank_offset"],  # the stand-in is one TP rank
                group_name=name,
                timeout_s=60,
            )
        elif name in state.groups:
            raise ValueError(_GROUP_EXISTS)
        else:
            state.groups[name] = None
    except Exception as exc:
        return 400, {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


# torch's `_new_process_group_helper`, given a name its process already has a group of.
_GROUP_EXISTS = "The specified group name has already been created, please use a different group name"


def _destroy_group(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    name = body.get("group_name", "weight_update_group")
    if name not in state.groups:
        return 400, {"success": False, "message": "The group to be destroyed does not exist."}
    group = state.groups.pop(name)
    if group is not None:
        torch.distributed.destroy_process_group(group)
    state.destroyed.append(name)
    return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def _update_version(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    """SGLang's /update_weight_version: aborts every request first unless `abort_all_requests` is false."""
    if body.get("abort_all_requests", True):
        state.in_flight = 0
    state.weight_version = body["new_version"]
    return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}"}


def _abort(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    if body.get("abort_all"):
        _abort_all(state)
    return 200, None


def _abort_all(state: StandInState) -> None:
    """Requests in flight end after `aborts_needed` aborts (SGLang's /v1/loads can lag its aborts)."""
    state.aborts_needed -= 1
    if state.aborts_needed <= 0:
        state.in_flight, state.aborts_needed = 0, 1


def _empty_bucket(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, Any]:
    """`FlattenedTensorBucket.empty`: offsets in order, each a multiple of its dtype's size."""
    metadata, offset = [], 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        if offset % dtype.itemsize:
            raise _Refused(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        metadata.append(
            types.SimpleNamespace(
                name=name, shape=torch.Size(shape), dtype=dtype, start_idx=offset, end_idx=offset + size, numel=size
            )
        )
        offset += size
    return {"flattened_tensor": torch.empty(offset, dtype=torch.uint8), "metadata": metadata}


def _update_from_distributed(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    refused = _session_required(state, "update_weights_from_distributed")
    if refused:
        return refused
    if state.fail_next_update is not None:
        message, state.fail_next_update = state.fail_next_update, None
        return 400, {"success": False, "message": message}
    if not len(names) == len(dtypes) == len(shapes):
        return 400, {"success": False, "message": "names, dtypes and shapes differ in length"}
    bad = [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
    if bad:
        return 400, {"success": False, "message": f"unknown dtype(s) {bad}"}
    state.distributed.append(body)
    if state.join_groups:
        group = state.groups.get(body["group_name"])
        if group is None:
            raise _Refused(
                f"Group {body['group_name']} not in {list(state.groups)}: call init_weights_update_group first"
            )
        if body.get("load_format") != "flattened_bucket":
            raise _Refused("the stand-in receives load_format='flattened_bucket' broadcasts only")
        bucket = _empty_bucket(names, dtypes, shapes)
        torch.distributed.broadcast(bucket["flattened_tensor"], src=0, group=group)
        named = reconstruct(bucket)
        state.loaded.update(named)
        state.buckets.append([(n, tuple(t.shape), t.dtype) for n, t in named])
        if state.model is not None:
            state.model.update_weights(named, state.sessions + 1)
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


def _generate(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    if not state.loaded and not state.distributed:
        return 400, {"error": {"message": "no weights were ever loaded: the output would be garbage"}}
    released = sorted(state.released & {"weights", "kv_cache"})
    if released:
        return 400, {"error": {"message": f"memory released: {released}"}}
    if state.paused is not None:  # SGLang would hold the request until /continue_generation
        return 400, {"error": {"message": f"generation is paused ({state.paused}): the request would wait"}}
    sampling = body.get("sampling_params") or {}
    per_row = sampling if isinstance(sampling, list) else [sampling] * len(body["input_ids"])
    if state.model is not None:
        return 200, _generate_with(state.model, body["input_ids"], per_row, state)
    results = []
    for prompt, params in zip(body["input_ids"], per_row, strict=True):
        max_new = int(params.get("max_new_tokens", 4))
        ids = [(sum(prompt) + i) % 97 for i in range(max_new)]
        meta = {
            "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(ids)],
            "finish_reason": {"type": "length", "length": max_new},
            "weight_version": state.weight_version,
        }
        results.append({"output_ids": ids, "meta_info": meta})
    return 200, results


def _generate_with(model: Any, input_ids: list[list[int]], per_row: list[Any], state: StandInState) -> list[Any]:
    """Sample from the model: every row at full length (`ignore_eos`), seeded by the first row's seed."""
    first = per_row[0]
    max_new = int(first.get("max_new_tokens", 128))
    completions, logprobs = model.generate(
        torch.tensor(input_ids, dtype=torch.int64),
        max_new_tokens=max_new,
        temperature=float(first.get("temperature", 1.0)),
        seed=int(first.get("sampling_seed") or 0),
    )
    results = []
    for ids, lps in zip(completions.tolist(), logprobs.tolist(), strict=True):
        meta = {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
            "finish_reason": {"type": "length", "length": max_new},
            "weight_version": state.weight_version,
        }
        results.append({"output_ids": ids, "meta_info": meta})
    return results


def _checksums(server: SGLangStandIn, state: StandInState, body: Any) -> tuple[int, Any]:
    """/weights_checker `checksum` over what was loaded, hashed as SGLang hashes CPU tensors
    (`tensor_hash`: the first 8 bytes of a SHA256 of the bytes, as 16 hex digits)."""
    checksums = {name: tensor_checksum(t) for name, t in state.loaded.items()}
    return 200, {"success": True, "message": "", "ranks": [{"checksums": checksums}]}


def tensor_checksum(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def _pause(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    state.paused = body.get("mode", "abort")
    if state.paused not in ("abort", "retract", "in_place"):
        raise _Refused(f"pause_generation mode {state.paused!r}: not abort, retract or in_place")
    if state.paused == "abort":  # SGLang's tokenizer manager aborts every request in flight
        _abort_all(state)
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def _continue(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    state.paused = None
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


_ROUTES = {
    ("POST", "/release_memory_occupation"): _release,
    ("POST", "/resume_memory_occupation"): _resume,
    ("POST", "/flush_cache"): _flush,
    ("POST", "/update_weights_from_tensor"): _update_from_tensor,
    ("POST", "/begin_weight_update"): _begin,
    ("POST", "/end_weight_update"): _end,
    ("POST", "/init_weights_update_group"): _init_group,
    ("POST", "/destroy_weights_update_group"): _destroy_group,
    ("POST", "/update_weight_version"): _update_version,
    ("POST", "/abort_request"): _abort,
    ("POST", "/update_weights_from_distributed"): _update_from_distributed,
    ("POST", "/generate"): _generate,
    ("POST", "/pause_generation"): _pause,
    ("POST", "/weights_checker"): _checksums,
    ("POST", "/continue_generation"): _continue,
    ("GET", "/health"): lambda server, state, body: (200, None),
    ("GET", "/_stand_in/state"): lambda server, state, body: (200, _observed(state)),
    ("POST", "/_stand_in/inject"): lambda server, state, body: _inject(server, state, body),
    ("GET", "/model_info"): lambda server, state, body: (200, _model_info(state)),
    ("GET", "/server_info"): lambda server, state, body: (200, _server_info(server, state)),
    # SGLang's `TokenizerManager.is_ready`: not paused (and healthy)
    ("GET", "/ready"): lambda server, state, body: (200 if state.paused is None else 503, None),
    (
        "GET",
        "/v1/loads",
    ): lambda server, state, body: (
        200,
        {"loads": [{"dp_rank": 0, "num_running_reqs": state.in_flight, "num_waiting_reqs": 0}]},
    ),
}


def _server_info(server: SGLangStandIn, state: StandInState) -> dict[str, Any]:
    """Some of the `ServerArgs` fields SGLang's /server_info reports (`build_server_info`: its
    resolved arguments, `version`, and `internal_states` per DP rank, with no `memory_usage` here:
    no scheduler sized a KV pool), as a server started on `model_path` would hold them."""
    args = {
        "tp_size": state.tp_size,
        "pp_size": 1,
        "dp_size": 1,
        "enable_memory_saver": state.memory_saver,
        "mem_fraction_static": state.mem_fraction_static,
        "max_total_tokens": None,
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "device": "cuda" if state.model is not None and str(state.model.device).startswith("cuda") else "cpu",
        "model_path": state.model_path,
        "skip_tokenizer_init": state.skip_tokenizer_init,
    }
    return {**args, "internal_states": [{}], "version": server.sglang_version}


def _model_info(state: StandInState) -> dict[str, Any]:
    """SGLang's /model_info keys that colocate reads (`weight_version`, `model_path`), with the
    model's `model_type` and `architectures` read from the folder's config.json as SGLang's
    `ModelConfig` reads them."""
    config: dict[str, Any] = {}
    folder = Path(state.model_path or "")
    if state.model_path is not None and (folder / "config.json").is_file():  # else a hub id, say
        config = json.loads((folder / "config.json").read_text())
    return {
        "model_path": state.model_path,
        "weight_version": state.weight_version,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "is_generation": True,
    }


def _observed(state: StandInState) -> dict[str, Any]:
    """What a test reads of a stand-in in a process of its own (not an SGLang route)."""
    return {
        "versions": state.versions,
        "groups": sorted(state.groups),
        "destroyed": state.destroyed,
        "paused": state.paused,
        "session_open": state.session_open,
        "released": sorted(state.released),
        "routes": [path for path, _ in state.requests],
    }


_INJECTABLE = ("fail_at_bucket", "fail_in_session", "fail_next_join", "fail_next_update")


def _inject(server: SGLangStandIn, state: StandInState, body: dict[str, Any]) -> tuple[int, Any]:
    """POST /_stand_in/inject {field: value}: a failure for a stand-in in a process of its own."""
    unknown = sorted(set(body) - set(_INJECTABLE))
    if unknown:
        raise _Refused(f"cannot inject {unknown}; injectable: {', '.join(_INJECTABLE)}")
    for name, value in body.items():
        setattr(state, name, value)
    return 200, None


def _handler(server: SGLangStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the engine's session expects
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

        def log_message(self, format: str, *args: Any) -> None:  # quiet test output
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
                status, content = server.handle(method, self.path, body, self.headers.get("traceparent"))
            except _Died:
                self.close_connection = True
                return
            except _Refused as exc:
                status, content = exc.status, {"object": "error", "message": str(exc), "code": exc.status}
            except (LookupError, ValueError, RuntimeError) as exc:  # the model refused (EngineError is one)
                status, content = 400, {"object": "error", "message": f"{type(exc).__name__}: {exc}", "code": 400}
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the SGLang stand-in until killed; print its URL first.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model-path", help="a folder with a Llama config.json (`colocate engine-config`) to serve")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--join-groups", action="store_true", help="really join weight-update groups")
    parser.add_argument("--disable-memory-saver", action="store_true", help="report enable_memory_saver false")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8, help="what /server_info reports")
    args = parser.parse_args(argv)
    model = None
    if args.model_path:
        from transformers import LlamaConfig

        from orchestrator.adapters.engines.transformers import TransformersEngine
        from orchestrator.adapters.megatron.convert import ATTN_IMPLEMENTATION
        from orchestrator.job.grpo import GRPOConfig

        config = LlamaConfig.from_pretrained(args.model_path, attn_implementation=ATTN_IMPLEMENTATION)
        grpo = GRPOConfig()  # the largest batch `colocate run` sends
        model = TransformersEngine(config, max_batch=grpo.prompts_per_step * grpo.group_size, device=args.device)
    with SGLangStandIn(model=model, port=args.port, join_groups=args.join_groups) as server:
        server.state.memory_saver = not args.disable_memory_saver
        server.state.mem_fraction_static = args.mem_fraction_static
        server.state.model_path = str(Path(args.model_path).resolve()) if args.model_path else None
        print(server.url, flush=True)
        server._thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
