"""`RolloutEngine` over SGLang's HTTP server (checked against sglang 0.5.23's source, design §4).

One `requests.Session` per engine, with urllib3 `Retry` on its adapter: connection failures are
retried a few times with backoff (the request never reached the server, so this is safe for POSTs);
502/503/504 are retried for GETs only; a read timeout is never retried, since SGLang may have
applied the call. An unreachable URL raises `EngineError` naming it within a few seconds.

Routes, as sglang 0.5.23's `sglang/srt/entrypoints/http_server.py` defines them:

- `release`/`resume`: POST /release_memory_occupation, /resume_memory_occupation {"tags": [...]}.
  SGLang's scheduler *asserts* it is idle on release: colocate's `engine_idle` guard must hold.
- `flush_cache`: POST /flush_cache; 400 while requests run. Retried (the one hand-rolled loop here)
  until `flush_max_wait_s`, then `EngineError`. 0.5.23 also takes `?timeout=` to wait server-side;
  not relied on, since older 0.5.x releases lack it.
- `weight_version`: GET /model_info, key `weight_version`. 0.5.23 has no /get_weight_version
  route (earlier 0.5.x had one); /model_info is where 0.5.23 reports what `weight_version=` set.
  The server's own initial value ("default", or null) reads as None.
- `server_info`: GET /server_info, the resolved server arguments: `tp_size` (one payload per TP
  rank), `enable_memory_saver` (without it a server cannot release memory) and `version` (the
  sglang release; `connect()` refuses one outside `SUPPORTED_SGLANG`). 0.5.23 also serves the
  deprecated /get_server_info, and no /version.
- `is_idle`: GET /v1/loads?include=core: per DP rank `num_running_reqs` and `num_waiting_reqs`.
  It is a snapshot the schedulers publish each step, so it can lag one step; /flush_cache's 400
  remains the authoritative busy signal.
- `begin_weight_update`/`end_weight_update`: POST /begin_weight_update, /end_weight_update {}.
  0.5.23's scheduler (`SchedulerWeightUpdaterManager`) refuses any update outside this session;
  the lifecycle holds one open over its update window (`SGLangGroup.weight_update_session`).
- `update_weights`: one flattened bucket per POST /update_weights_from_tensor (see `_payload`).
- `update_weights_from_distributed`: metadata only; the tensors travel by NCCL broadcast from the
  trainer over a group made by `init_weights_update_group` (engines off the trainer's GPUs).
- `generate`: POST /generate with `input_ids`, `sampling_params`, `return_logprob`. Never
  `min_new_tokens`: `SamplingParams.normalize` refuses it under `--skip-tokenizer-init`.

Every POST is a client span `sglang POST <path>` with OpenTelemetry's HTTP client attributes,
`server.address` (the host), `server.port`, `url.full`, `http.response.status_code` (GETs are
queries the lifecycle makes around every transition, and have none), and every request carries the W3C
`traceparent` header (SGLang started with `--enable-trace` continues the trace).

`SGLangGroup` is what `colocate run --engine sglang` drives: every server of the job (one per
`--engine-url`) behind one `RolloutEngine`, and the job's rollout over all of them.

Serialization is SGLang's `MultiprocessingSerializer` wire format, reimplemented here without
importing sglang: `ForkingPickler` (torch's tensor reductions: CUDA IPC handles on GPU, shared
memory files on CPU), then standard base64, one copy per TP rank (each rank unpickles only its
own, which keeps CUDA IPC refcounts right). CPU storages go by shared-memory file *name*
(what torch's `file_system` strategy sends), chosen by the pickler, never by the process-wide
strategy: torch's default passes a file descriptor through multiprocessing's resource sharer,
which answers only processes holding the sender's authkey, and a server is no child of the
trainer (see `_Pickler`). As SGLang's patched reductions do,
a CUDA tensor's device index is replaced by the device UUID, so trainer and engine need not agree
on device numbering; SGLang's receiver patches `rebuild_cuda_tensor` to accept it.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
import re
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any
from urllib.parse import urlsplit

import requests
import torch
from opentelemetry import propagate, trace
from requests.adapters import HTTPAdapter
from torch.multiprocessing import reductions  # importing it registers torch's reductions with ForkingPickler
from urllib3.util.retry import Retry

from orchestrator.errors import ConfigError, EngineError
from orchestrator.protocols import Named
from states import EngineMemory

__all__ = [
    "SUPPORTED_SGLANG",
    "Generation",
    "SGLangEngine",
    "SGLangGroup",
    "WeightBroadcaster",
    "flattened_bucket",
    "serialize",
    "url_problems",
    "version_problem",
    "weight_update_group",
]

_CUDA_DEVICE_ARG = 6  # index of `device` in torch's reduce_tensor args for CUDA tensors (SGLang's patch_torch)
_NO_VERSION = (None, "", "default")  # what SGLang reports before any versioned update

# The SGLang releases colocate speaks to: the weight-update session (/begin_weight_update,
# /end_weight_update) that 0.5.23's scheduler requires, /model_info's weight_version, no
# /get_weight_version. Lower bound inclusive, upper bound exclusive.
SUPPORTED_SGLANG = ((0, 5, 23), (0, 6, 0))
SUPPORTED_SGLANG_TEXT = ">=0.5.23, <0.6"


def version_problem(reported: object) -> str | None:
    """Why a server reporting `reported` as its version cannot be driven, or None."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", str(reported or ""))
    if match is None:
        return f"reports no SGLang version ({reported!r}); colocate supports sglang {SUPPORTED_SGLANG_TEXT}"
    found = tuple(int(part) for part in match.groups())
    low, high = SUPPORTED_SGLANG
    if not low <= found < high:
        return f"runs sglang {reported}; colocate supports sglang {SUPPORTED_SGLANG_TEXT}"
    return None


@dataclass(frozen=True, slots=True)
class Generation:
    """One completion: sampled token ids and the log-probability of each."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Any = None
    weight_version: str | None = None


class _Pickler(ForkingPickler):
    """ForkingPickler with SGLang's wire choices, decided per pickler, never per process.

    - A CUDA tensor carries its device UUID where torch puts the device index, as sglang's
      `patch_torch` does.
    - A CPU storage goes by shared-memory file *name* (what torch's `file_system` strategy sends),
      whatever `torch.multiprocessing`'s process-wide strategy is: the default (`file_descriptor`)
      passes a descriptor through multiprocessing's resource sharer, which answers only processes
      holding this process's authkey, and a server is no child of the trainer. Setting the strategy
      around each call instead would race: `SGLangGroup` pickles for several servers at once from
      threads, and one thread restored the strategy while another was still pickling.
    - Tensors are reduced by torch's own `reduce_tensor`, whatever ForkingPickler's process-wide
      table holds: sglang's `monkey_patch_torch_reductions` replaces it there with a version that
      fails on CPU tensors, which matters where both live in one process (the contract tier).
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            rebuild, args = _torch_reduce_tensor(obj)
            if not obj.is_cuda:
                return rebuild, args
            uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
            return rebuild, (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu":
            return _reduce_storage_by_name(obj)
        return NotImplemented


# torch's tensor reduction, as torch defines it (sglang keeps the original under this name when it patches).
_torch_reduce_tensor = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """torch's `reduce_storage` under the `file_system` strategy, for this storage only."""
    _start_shm_manager_quietly()
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild decrefs, as with torch's own reduction
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), *metadata)


_shm_manager_lock = threading.Lock()
_shm_manager_started = False


def _start_shm_manager_quietly() -> None:
    """Start torch's `torch_shm_manager` with stderr on /dev/null, once per process.

    The first CPU storage shared by file name starts that daemon, which inherits stderr and lives
    as long as any process maps a shared file: a server's, possibly longer than this process. It
    would hold the caller's stderr pipe open (`colocate run 2>&1 | tee log` would never end).
    Redirecting fd 2 is process-wide, so it happens once, under a lock held for that one start.
    """
    global _shm_manager_started
    with _shm_manager_lock:
        if _shm_manager_started:
            return
        saved = os.dup(2)
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        try:
            torch.empty(1).untyped_storage()._share_filename_cpu_()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        _shm_manager_started = True


def serialize(obj: object) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`: `_Pickler`, then
    standard base64. Reads and changes no process-global setting, so threads may call it at once."""
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flattened_bucket(named: Sequence[Named]) -> dict[str, Any]:
    """The dict SGLang's `_update_weights_from_flattened_bucket` reads.

    `flattened_tensor`: every tensor's bytes, concatenated (uint8, one device). `metadata`: per
    tensor `name, shape, dtype, start_idx, end_idx, numel` (byte offsets), the fields of SGLang's
    `FlattenedTensorMetadata`. Entries are `types.SimpleNamespace`: SGLang reads them by attribute
    and its SafeUnpickler allows that type; pickling SGLang's own class would need sglang here.

    SGLang rebuilds each tensor as a `view(dtype)` of its byte range, which torch refuses unless
    the offset is a multiple of the dtype's size (an odd-length bf16 tensor before an fp32 one).
    So the widest dtypes go first: every offset is then aligned, with no padding.
    """
    if not named:
        raise ValueError("cannot send an empty bucket")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        raise ValueError(f"one bucket, one device: got {sorted(map(str, devices))}")
    chunks, metadata, offset = [], [], 0
    for name, tensor in sorted(named, key=lambda pair: -pair[1].element_size()):  # stable: same-width order kept
        chunk = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + chunk.numel(),
                numel=chunk.numel(),
            )
        )
        chunks.append(chunk)
        offset += chunk.numel()
    return {"flattened_tensor": torch.cat(chunks), "metadata": metadata}


def _session(retries: int) -> requests.Session:
    retry = Retry(
        total=retries,
        connect=retries,
        read=0,  # the server may have applied the call
        status=retries,
        status_forcelist=(502, 503, 504),
        allowed_methods=frozenset({"GET"}),  # statuses: retry reads only
        backoff_factor=0.2,
        raise_on_status=False,
    )
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _message(response: requests.Response) -> str:
    """The error text of any SGLang error shape: {success, message}, {error: {message}}, {message}, text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)


class SGLangEngine:
    """Implements `orchestrator.protocols.RolloutEngine` for one SGLang server; `name` is its URL.

    `tp_size` is the server's tensor-parallel size (one serialized payload per TP rank).
    Timeouts: `connect_timeout_s` for the TCP connect, `read_timeout_s` for an answer.
    """

    def __init__(
        self,
        url: str,
        *,
        tp_size: int = 1,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 600.0,
        retries: int = 2,
        flush_max_wait_s: float = 60.0,
        flush_poll_s: float = 0.25,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.name = url.rstrip("/")
        self.tp_size = tp_size
        self.flush_max_wait_s, self.flush_poll_s = flush_max_wait_s, flush_poll_s
        self._timeout = (connect_timeout_s, read_timeout_s)
        self._session = _session(retries)
        parts = urlsplit(self.name)  # OTel HTTP client conventions: the host alone, the port apart
        self._server_attributes: dict[str, str | int] = {
            "server.address": parts.hostname or "",
            "server.port": parts.port or (443 if parts.scheme == "https" else 80),
        }

    def close(self) -> None:
        self._session.close()

    # ---- HTTP ------------------------------------------------------------------------------

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> requests.Response:
        """One request. A POST (an action) is a client span; a GET (a query the lifecycle makes
        around every transition) is not, as it would bury the work."""
        if method == "GET":
            return self._request(method, path, body)
        attributes = {**self._server_attributes, "url.full": self.name + path, "http.request.method": method}
        with trace.get_tracer("colocate").start_as_current_span(
            f"sglang {method} {path.split('?', 1)[0]}", kind=trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            response = self._request(method, path, body)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None) -> requests.Response:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        try:
            return self._session.request(method, self.name + path, json=body, headers=headers, timeout=self._timeout)
        except requests.RequestException as exc:
            raise EngineError(self.name, f"{method} {path}: {self._unreachable(exc)}") from exc

    def _unreachable(self, exc: requests.RequestException) -> str:
        """Why no answer came, in a few words (urllib3's own text repeats the URL and the retries)."""
        if isinstance(exc, requests.ConnectTimeout):
            return f"unreachable: no connection within {self._timeout[0]:g} s"
        if isinstance(exc, requests.ReadTimeout):
            return f"no answer within {self._timeout[1]:g} s"
        errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(exc))
        return f"unreachable: {errno.group(1).strip()}" if errno else f"{type(exc).__name__}: {exc}"

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """Send; raise EngineError on an HTTP error or `success: false`; return the JSON body (or None)."""
        response = self._send(method, path, body)
        if response.status_code >= 400:
            raise EngineError(self.name, f"{path}: HTTP {response.status_code}: {_message(response)}")
        try:
            result = response.json() if response.content else None
        except ValueError:
            return response.text
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(self.name, f"{path}: {result.get('message', 'success=false')}")
        return result

    # ---- the RolloutEngine Protocol --------------------------------------------------------

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self._call("POST", "/release_memory_occupation", {"tags": sorted(tags)})

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self._call("POST", "/resume_memory_occupation", {"tags": sorted(tags)})

    def flush_cache(self) -> None:
        """Flush; while SGLang answers 400 (requests in flight) ask again, up to `flush_max_wait_s`."""
        deadline = time.monotonic() + self.flush_max_wait_s
        while True:
            response = self._send("POST", "/flush_cache")
            if response.status_code == 200:
                return
            if response.status_code != 400:
                raise EngineError(self.name, f"/flush_cache: HTTP {response.status_code}: {_message(response)}")
            if time.monotonic() + self.flush_poll_s > deadline:
                raise EngineError(
                    self.name,
                    f"/flush_cache still refused after {self.flush_max_wait_s:g} s (requests in flight): "
                    f"{_message(response)}",
                )
            time.sleep(self.flush_poll_s)

    def weight_version(self) -> int | None:
        reported = (self._call("GET", "/model_info") or {}).get("weight_version")
        if reported in _NO_VERSION:
            return None
        try:
            return int(reported)
        except (TypeError, ValueError):
            raise EngineError(self.name, f"weight_version {reported!r} is not one colocate set") from None

    def is_idle(self) -> bool:
        loads = (self._call("GET", "/v1/loads?include=core") or {}).get("loads")
        if not isinstance(loads, list) or not loads:
            raise EngineError(self.name, f"/v1/loads returned no per-rank loads: {loads!r}")
        return all(load.get("num_running_reqs", 0) == 0 and load.get("num_waiting_reqs", 0) == 0 for load in loads)

    # ---- serving control -------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's modes: `abort` (return running requests), `retract` (requeue them, KV flushable),
        `in_place` (keep them and their KV; /flush_cache then fails while they exist)."""
        self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {})

    def server_info(self) -> dict[str, Any]:
        """The server's resolved arguments (`tp_size`, `enable_memory_saver`, ...) and version."""
        return dict(self._call("GET", "/server_info") or {})

    def health(self) -> bool:
        """True when /health answers 200; False on any other answer or no answer."""
        try:
            return self._send("GET", "/health").status_code == 200
        except EngineError:
            return False

    def wait_until_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll /health until it answers 200 (a starting server answers 503 or refuses connections)."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() + poll_s > deadline:
                raise EngineError(self.name, f"/health not ready after {timeout_s:g} s")
            time.sleep(poll_s)

    # ---- weights ---------------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session; 0.5.23's scheduler refuses every
        /update_weights_from_tensor and /update_weights_from_distributed outside one."""
        self._call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> None:
        """Close the session (SGLang finalizes the loaded weights here)."""
        self._call("POST", "/end_weight_update", {})

    @contextmanager
    def weight_update_session(self) -> Iterator[None]:
        """The session around the body; closed whether the body returned or raised."""
        self.begin_weight_update()
        try:
            yield
        except BaseException as exc:
            _close_quietly([self], exc)
            raise
        self.end_weight_update()

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """Send one bucket of HF-named tensors, tagged `version`; returns the bytes sent.

        The flattened tensor stays referenced until SGLang answers: its CUDA IPC handle is only
        valid while this process holds the memory. The cache is not flushed here (`flush_cache=False`):
        colocate flushes once after the last bucket, under the `cache_flushed` guard.
        """
        bucket = flattened_bucket(named)
        payloads = [serialize(bucket) for _ in range(self.tp_size)]
        self._call(
            "POST",
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": payloads,
                "load_format": "flattened_bucket",
                "flush_cache": False,
                "weight_version": str(version),
            },
        )
        return int(bucket["flattened_tensor"].numel())

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's broadcast group (engines outside the trainer's GPUs)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._call("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        version: int,
        *,
        flattened: bool = False,
    ) -> None:
        """Announce tensors the trainer broadcasts over `group_name`; returns once SGLang received
        them. `flattened`: one uint8 broadcast laid out as `flattened_bucket` lays it out."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
        body = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
            "weight_version": str(version),
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        self._call("POST", "/update_weights_from_distributed", body)

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self, input_ids: Sequence[Sequence[int]], sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> list[Generation]:
        """One completion per prompt, with the log-probability of each sampled token.

        `sampling_params`: one dict for every prompt, or a list of one dict per prompt."""
        prompts = [[int(t) for t in row] for row in input_ids]
        params: dict[str, Any] | list[dict[str, Any]] = (
            dict(sampling_params) if isinstance(sampling_params, Mapping) else [dict(p) for p in sampling_params]
        )
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        body = {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
        result = self._call("POST", "/generate", body)
        if not isinstance(result, list) or len(result) != len(prompts):
            raise EngineError(self.name, f"/generate: expected {len(prompts)} results, got {result!r:.200}")
        return [self._generation(item) for item in result]

    def _generation(self, item: Mapping[str, Any]) -> Generation:
        meta = item.get("meta_info", {})
        token_ids = [int(t) for t in item.get("output_ids", [])]
        # SGLang: [[logprob, token_id, text_or_null], ...] for the output tokens.
        logprob_rows = meta.get("output_token_logprobs", [])
        if [int(row[1]) for row in logprob_rows] != token_ids:
            raise EngineError(self.name, "/generate: output_token_logprobs do not match output_ids")
        return Generation(
            token_ids=token_ids,
            logprobs=[float(row[0]) for row in logprob_rows],
            finish_reason=meta.get("finish_reason"),
            weight_version=meta.get("weight_version"),
        )


# ---- servers off the trainer's GPUs: a broadcast group ----------------------------------------


def weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> Any:
    """A process group beside the default one, made as SGLang's `init_custom_process_group`
    (sglang/srt/utils/common.py) makes it, since both ends must take the same steps: a TCP
    rendezvous hosted by rank 0, a `PrefixStore(group_name)`, then torch's (private)
    `_new_process_group_helper`, whose group ranks are the world ranks."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    name: Any = group_name  # a str; torch 2.13 types it as its GroupName NewType, 2.11 lacks that
    group, _ = _new_process_group_helper(
        world_size, rank, [], backend, PrefixStore(group_name, store), group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class WeightBroadcaster:
    """The trainer's end of SGLang's weight-update group, for servers off the trainer's GPUs.

    This process is rank 0; each server's TP ranks follow (`rank_offset` 1, 1 + tp, ...). The
    servers join by /init_weights_update_group while this process hosts the rendezvous. Each
    bucket is announced by /update_weights_from_distributed while this process broadcasts it as
    one flattened uint8 tensor; SGLang answers once it has received it.

    A server that refuses an announcement never receives. The broadcast is started
    asynchronously, so the refusal is raised at once (an `EngineError` naming the server); the
    group is aborted, which cancels NCCL's pending work, while gloo's ends at the group's
    `timeout_s` (this process may wait that long to exit). The broadcaster then refuses any
    further use: the group is out of step.
    """

    def __init__(
        self,
        engines: Sequence[SGLangEngine],
        *,
        master_port: int,
        master_address: str = "127.0.0.1",
        backend: str = "nccl",
        group_name: str = "colocate_weights",
        timeout_s: float = 300.0,
    ) -> None:
        self.engines, self.group_name = list(engines), group_name
        self._broken: str | None = None
        offsets = list(itertools.accumulate([1] + [e.tp_size for e in self.engines[:-1]]))
        world_size = 1 + sum(e.tp_size for e in self.engines)
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="sglang-join") as pool:
            joins = [
                pool.submit(
                    e.init_weights_update_group,
                    master_address,
                    master_port,
                    offset,
                    world_size,
                    group_name=group_name,
                    backend=backend,
                )
                for e, offset in zip(self.engines, offsets, strict=True)
            ]
            self._group = weight_update_group(
                backend=backend,
                master_address=master_address,
                master_port=master_port,
                world_size=world_size,
                rank=0,
                group_name=group_name,
                timeout_s=timeout_s,
            )
            for join in joins:
                join.result()

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """Broadcast one bucket to every server, tagged `version`; returns the bytes broadcast."""
        if self._broken is not None:
            raise EngineError(self._broken, "an earlier broadcast was refused: the weight-update group is out of step")
        bucket = flattened_bucket(named)
        meta = bucket["metadata"]
        names, dtypes, shapes = [m.name for m in meta], [m.dtype for m in meta], [list(m.shape) for m in meta]
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="sglang-announce") as pool:
            announced = {
                e.name: pool.submit(
                    e.update_weights_from_distributed, names, dtypes, shapes, self.group_name, version, flattened=True
                )
                for e in self.engines
            }
            work = torch.distributed.broadcast(bucket["flattened_tensor"], src=0, group=self._group, async_op=True)
            for name, answer in announced.items():
                try:
                    answer.result()
                except EngineError:
                    self._broken = name
                    self._group.abort()
                    raise
            work.wait()
        return int(bucket["flattened_tensor"].numel())

    def close(self) -> None:
        torch.distributed.destroy_process_group(self._group)


def url_problems(urls: Sequence[str]) -> list[str]:
    """What is wrong with a list of server URLs: none, not http(s), or one given twice."""
    if not urls:
        return ["no SGLang server URL given"]
    problems = [
        f"server URL {url!r}: not an http:// or https:// URL"
        for url in urls
        if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1].strip("/")
    ]
    names = [url.rstrip("/") for url in urls]
    return problems + [f"server URL {url} given twice" for url in sorted({u for u in names if names.count(u) > 1})]


# ---- every server of a job -------------------------------------------------------------------


class SGLangGroup:
    """Several SGLang servers (data-parallel replicas, one URL each) as one `RolloutEngine`.

    Memory calls, flushes and weight buckets go to every server, concurrently; the version is
    the one they all serve (servers that disagree are an `EngineError` naming each one's). The
    rollout splits the prompts into contiguous shares, one per server.

    It implements the job's engine (`orchestrator.protocols.JobEngine`) too: `generate` takes and
    returns tensors, and `digests()` is None, since SGLang's HTTP API has no way to read every
    weight back.
    """

    def __init__(self, urls: Sequence[str], **engine_options: Any) -> None:
        problems = url_problems(urls)
        if problems:
            raise ConfigError(problems)
        names = [url.rstrip("/") for url in urls]
        self.engines = [SGLangEngine(url, **engine_options) for url in urls]
        self.name = self.engines[0].name if len(self.engines) == 1 else f"sglang[{', '.join(names)}]"

    def _each(self, call: Callable[[SGLangEngine], Any]) -> list[Any]:
        """`call` on every server at once; results in URL order; the first failure, re-raised."""
        if len(self.engines) == 1:
            return [call(self.engines[0])]
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="sglang") as pool:
            return list(pool.map(call, self.engines))

    def connect(self, timeout_s: float = 0.0) -> None:
        """Check every server answers and can serve colocated; take each one's TP size.

        Waits up to `timeout_s` for a server that is starting. An unreachable server is an
        `EngineError` naming its URL: a refused connection fails within a second, an unroutable
        host after the connect timeout and its retries. A server started without
        `--enable-memory-saver` is refused: it could not give its memory to the trainer. So is an
        SGLang outside `SUPPORTED_SGLANG` (its `version`, from /server_info): the error names the range.
        """

        def check(engine: SGLangEngine) -> None:
            if timeout_s > 0:
                engine.wait_until_ready(timeout_s)
            try:
                info = engine.server_info()
            except EngineError as exc:
                if "HTTP 404" not in exc.reason:
                    raise
                raise EngineError(engine.name, f"{exc.reason}: is this an SGLang 0.5 server?") from exc
            problem = version_problem(info.get("version"))
            if problem:
                raise EngineError(engine.name, problem)
            if not info.get("enable_memory_saver"):
                raise EngineError(
                    engine.name, "started without --enable-memory-saver: it cannot release memory for the trainer"
                )
            engine.tp_size = int(info.get("tp_size") or 1)

        self._each(check)
        self.weight_version()

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    # ---- the RolloutEngine Protocol --------------------------------------------------------

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self._each(lambda e: e.release(tags))

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self._each(lambda e: e.resume(tags))

    def flush_cache(self) -> None:
        self._each(SGLangEngine.flush_cache)

    def weight_version(self) -> int | None:
        versions = dict(zip((e.name for e in self.engines), self._each(SGLangEngine.weight_version), strict=True))
        if len(set(versions.values())) > 1:
            raise EngineError(self.name, f"the servers serve different weight versions: {versions}")
        return next(iter(versions.values()))

    def is_idle(self) -> bool:
        return all(self._each(SGLangEngine.is_idle))

    @contextmanager
    def weight_update_session(self) -> Iterator[None]:
        """Every server's weight-update session around the body: opened first, closed after it,
        whether the body returned or raised (the body's error is then the one raised).

        A server that refuses to open it closes the sessions the others opened, then raises.
        """
        opened: list[SGLangEngine] = []

        def begin(engine: SGLangEngine) -> None:
            engine.begin_weight_update()
            opened.append(engine)

        try:
            self._each(begin)
        except BaseException as exc:
            _close_quietly(opened, exc)
            raise
        try:
            yield
        except BaseException as exc:
            _close_quietly(opened, exc)
            raise
        self._each(SGLangEngine.end_weight_update)

    # ---- the job's engine ------------------------------------------------------------------

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """One bucket to every server; returns the bytes sent to all of them."""
        return sum(self._each(lambda e: e.update_weights(named, version)))

    def generate(
        self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly `max_new_tokens` sampled tokens per prompt row, and their log-probabilities.

        `ignore_eos` keeps every completion at full length, as the trainer's batch needs; no
        `min_new_tokens`, which SGLang refuses under `--skip-tokenizer-init` (it needs the tokenizer's
        eos_token_id) and which `ignore_eos` makes redundant. Each row
        gets its own `sampling_seed` (seed + row): SGLang honours it only under
        `--enable-deterministic-inference`, and a seed shared by a group's identical prompts would
        make their samples identical there.
        """
        rows = prompts.tolist()
        params = [
            {
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
                "temperature": temperature,
                "sampling_seed": seed + row,
            }
            for row in range(len(rows))
        ]
        share = dict(zip(self.engines, _shares(len(rows), len(self.engines)), strict=True))
        per_server = self._each(lambda e: e.generate(rows[share[e]], params[share[e]]) if rows[share[e]] else [])
        generations = [g for answers in per_server for g in answers]
        short = [(i, len(g.token_ids)) for i, g in enumerate(generations) if len(g.token_ids) != max_new_tokens]
        if short:
            raise EngineError(
                self.name, f"{len(short)} completions are not {max_new_tokens} tokens long (row, length): {short[:4]}"
            )
        completions = torch.tensor([g.token_ids for g in generations], dtype=torch.int64).reshape(len(rows), -1)
        logprobs = torch.tensor([g.logprobs for g in generations], dtype=torch.float32).reshape(len(rows), -1)
        return completions, logprobs

    def digests(self) -> None:
        """SGLang cannot report its weights in full, so `engine_matches_trainer` is not checked."""
        return None

    def flush_traces(self) -> None:
        """The servers export their own spans, if started with `--enable-trace`."""


def _close_quietly(engines: Sequence[SGLangEngine], error: BaseException) -> None:
    """End each server's session while `error` is on its way out: it stays the one raised, and
    a server that also refused to close is a note on it."""
    for engine in engines:
        try:
            engine.end_weight_update()
        except EngineError as exc:
            error.add_note(f"and the weight-update session stayed open: {exc}")


def _shares(rows: int, servers: int) -> list[slice]:
    """Contiguous, near-equal shares of `rows`, one per server (the first ones take the remainder)."""
    size, extra = divmod(rows, servers)
    starts = [i * size + min(i, extra) for i in range(servers + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(starts)]
