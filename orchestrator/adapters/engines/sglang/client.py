"""`RolloutEngine` over SGLang's HTTP server (checked against sglang 0.5.23's source: docs/sglang.md).

The HTTP underneath (the session, retries, client spans, SGLang's error shapes) is `http.py`'s
`SGLangHTTP`; the weight-update routes are `weights.py`'s `SGLangWeightUpdates`.

Routes, as sglang 0.5.23's `sglang/srt/entrypoints/http_server.py` defines them:

- `release`/`resume`: POST /release_memory_occupation, /resume_memory_occupation {"tags": [...]},
  sent only for what closes the difference (memory.py's `SGLangMemory`). SGLang's scheduler
  *asserts* it is idle on release: colocate's `engine_idle` guard must hold.
- `released`: no route reports it; the client keeps it (memory.py), from these facts of 0.5.23:
  1. The scheduler's `SchedulerWeightUpdaterManager` (managers/scheduler_components/
     weight_updater.py) keeps `offload_tags`, which no HTTP route reads (/server_info's
     `memory_usage` holds sizes fixed at startup).
  2. `release_memory_occupation` adds each tag to `offload_tags` without looking, then calls
     `memory_saver_adapter.pause(tag)`: for a tag already paused, torch_memory_saver's
     `TorchMemorySaver::pause` (csrc/core.cpp) prints "Cannot pause allocation that is not active"
     and calls `exit(1)`. A release of a released tag ends the server: never sent.
  3. `resume_memory_occupation` calls `offload_tags.remove(tag)` for each tag in the order sent,
     before resuming any: a tag not released raises `KeyError` there, after the tags before it
     were taken off `offload_tags` with their memory still paused (a later resume of those would
     raise the same `KeyError`: they could never come back). The `KeyError` is raised in the
     scheduler's process, whose event loop (managers/scheduler.py, `process_input_requests`)
     catches nothing: `run_scheduler_process` logs "Scheduler hit an exception" and sends SIGQUIT
     to the server, which exits. (SGLang's app answers 400 instead only where the scheduler runs
     in its own process, as in tests/support/sglang_tier.py.) A resume of a resident tag ends the
     server: never sent, so no request can probe what is released.
  4. What remains known: the scheduler handles requests one at a time, in the order received,
     and a release or resume it handled either completed or ended the server (2, 3; the idle
     assertion too). So after a call that was sent and got no answer, an answer to any later
     request the scheduler handles (memory.py uses /flush_cache) means that call was applied.
     Not covered: a request the server never read although it was sent (a kept-alive connection
     the server closed as the request went out); the client would count it applied.
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
- `model_info`: GET /model_info: `model_path` (what the server loaded its config from),
  `model_type`, `architectures`; the HF config itself is not in it (0.5.23 comments it out).
- `ready`: GET /ready, 503 while generation is paused (or the server is not healthy).
- `is_idle`: GET /v1/loads?include=core: per DP rank `num_running_reqs` and `num_waiting_reqs`.
  It is a snapshot the schedulers publish each step, so it can lag one step; /flush_cache's 400
  remains the authoritative busy signal.
- `begin_weight_update`/`end_weight_update`: POST /begin_weight_update, /end_weight_update {}.
  0.5.23's scheduler (`SchedulerWeightUpdaterManager`) refuses any update outside this session;
  the lifecycle holds one open over its update window (`SGLangGroup.weight_update_session`).
- `set_weight_version`: POST /update_weight_version {new_version, abort_all_requests: false},
  once per update, after its session closed cleanly; no bucket carries a `weight_version`.
- `pause_generation`/`continue_generation`: POST /pause_generation {mode}, /continue_generation
  {}, around an update; `abort` also sends /abort_request {abort_all: true} until idle.
- `update_weights`, `update_weights_from_payloads`: one flattened bucket per POST
  /update_weights_from_tensor, one payload per TP rank (TP rank i unpickles entry i alone).
  `update_weights` serializes every entry in this process, which holds every weight;
  `update_weights_from_payloads` posts entries each serialized by the trainer rank on that TP
  rank's GPU, from its own memory.
- `update_weights_from_distributed`: metadata only; the tensors travel by NCCL broadcast from the
  trainer over a group made by `init_weights_update_group` and ended by
  `destroy_weights_update_group` (engines off the trainer's GPUs).
- `generate`: POST /generate with `input_ids`, `sampling_params`, `return_logprob`. Never
  `min_new_tokens`: `SamplingParams.normalize` refuses it under `--skip-tokenizer-init`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.adapters.engines.sglang.http import _message
from orchestrator.adapters.engines.sglang.memory import SGLangMemory
from orchestrator.adapters.engines.sglang.weights import SGLangWeightUpdates
from orchestrator.core.config import EnginePause
from orchestrator.errors import EngineError
from orchestrator.protocols import EngineDefaults, EngineFeatures

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


class SGLangEngine(SGLangMemory, SGLangWeightUpdates, EngineDefaults):
    """Implements `orchestrator.protocols.RolloutEngine` for one SGLang server; `name` is its URL.

    `tp_size` is the server's tensor-parallel size (one serialized payload per TP rank).
    Timeouts: `connect_timeout_s` for the TCP connect, `read_timeout_s` for an answer.
    """

    features = EngineFeatures(sessions=True)

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
        super().__init__(url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, retries=retries)
        self.tp_size = tp_size
        self.flush_max_wait_s, self.flush_poll_s = flush_max_wait_s, flush_poll_s

    # ---- the RolloutEngine Protocol (release, resume, released: SGLangMemory) -----------------

    def flush_cache(self) -> None:
        """Flush; while SGLang answers 400 (requests in flight) ask again, up to `flush_max_wait_s`."""
        deadline = time.monotonic() + self.flush_max_wait_s
        while True:
            response = self._send("POST", "/flush_cache")
            if response.status_code == 200:
                return
            if response.status_code != 400:
                raise EngineError(
                    self.name, f"/flush_cache: HTTP {response.status_code}: {_message(response)}", response.status_code
                )
            if time.monotonic() + self.flush_poll_s > deadline:
                raise EngineError(
                    self.name,
                    f"/flush_cache still refused after {self.flush_max_wait_s:g} s (requests in flight): "
                    f"{_message(response)}",
                )
            time.sleep(self.flush_poll_s)

    def weight_version(self) -> int | None:
        reported = self.model_info().get("weight_version")
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

    def pause_generation(self, mode: EnginePause = EnginePause.RETRACT) -> None:
        """Hold generation for a weight update (`colocate run --engine-pause`), by SGLang 0.5.23's modes:

        - `retract`: running requests go back to the waiting queue, their KV cache freed; they
          are recomputed under the new weights after `continue_generation`. The scheduler is
          paused, so /flush_cache and a release ignore the waiting queue
          (`Scheduler.flush_cache`: `is_fully_idle(ignore_waiting=self._engine_paused)`).
        - `in_place`: running requests keep their place and their KV cache, computed with the
          old weights; /flush_cache is refused while they exist.
        - `abort`: the tokenizer manager aborts every request in flight and holds new ones; the
          scheduler is not paused, so this also repeats /abort_request until /v1/loads shows
          the server idle, up to `flush_max_wait_s`.
        - `none`: nothing is sent; the lifecycle's own idle checks stand alone.
        """
        if mode is EnginePause.NONE:
            return
        self._call("POST", "/pause_generation", {"mode": mode.value})
        if mode is not EnginePause.ABORT:
            return
        deadline = time.monotonic() + self.flush_max_wait_s
        while not self.is_idle():
            if time.monotonic() + self.flush_poll_s > deadline:
                raise EngineError(self.name, f"requests still in flight {self.flush_max_wait_s:g} s after aborting all")
            self._call("POST", "/abort_request", {"abort_all": True})
            time.sleep(self.flush_poll_s)

    def continue_generation(self, mode: EnginePause = EnginePause.RETRACT) -> None:
        """Let generation go on after `pause_generation(mode)`; nothing for `none`."""
        if mode is not EnginePause.NONE:
            self._call("POST", "/continue_generation", {})

    def server_info(self) -> dict[str, Any]:
        """The server's resolved arguments (`tp_size`, `enable_memory_saver`, ...) and version."""
        return dict(self._call("GET", "/server_info") or {})

    def model_info(self) -> dict[str, Any]:
        """What the server says of its model (`model_path`, `model_type`, `architectures`,
        `weight_version`, ...); SGLang 0.5.23 leaves the HF config itself out of it."""
        return dict(self._call("GET", "/model_info") or {})

    def ready(self) -> bool:
        """True when GET /ready answers 200: SGLang 0.5.23 answers 503 while generation is paused
        (`TokenizerManager.is_ready`: not `is_pause`, and healthy)."""
        return self._send("GET", "/ready").status_code == 200

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
