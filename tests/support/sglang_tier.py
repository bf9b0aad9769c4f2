"""sglang 0.5.23's own HTTP server, request handling and scheduler checks, with its model replaced.

Only in the contract tier's environment (`scripts/sglang-contract-tier.sh`): sglang installed
`--no-deps` beside a CPU torch. What runs is SGLang's code:

- its FastAPI app, `sglang.srt.entrypoints.http_server.app`, served by uvicorn on a local port:
  routing, request parsing into io_struct classes, `generate_contract_error`, error responses;
- `normalize_serialized_named_tensor_payloads`, as its TokenizerManager applies it to updates;
- for /generate, what its TokenizerManager does to each request: `GenerateReqInput
  .normalize_batch_and_arguments()`, then `SamplingParams(**params)`, `.normalize(tokenizer)`
  (None: the server is started with `--skip-tokenizer-init`) and `.verify(vocab_size)`;
- its scheduler's `SchedulerWeightUpdaterManager` (scheduler_components/weight_updater.py): the
  weight-update session, update_weights_from_tensor/distributed, release/resume memory (its idle
  assertion, its `offload_tags` bookkeeping), init_weights_update_group;
- its `Scheduler.flush_cache`, which refuses while requests run;
- each rank's deserialization, `MultiprocessingSerializer.deserialize` (SafeUnpickler) after
  `monkey_patch_torch_reductions`, and the flattened bucket rebuilt by `FlattenedTensorBucket`;
- the model folder read by its `ServerArgs` and `ModelConfig.from_server_args`, the model class
  chosen by its `ModelRegistry`; /server_info built by its `build_server_info`.

What is replaced, at the seam where the model runner would start (a GPU, CUDA kernels):

- the TokenizerManager↔scheduler hop (ZMQ between processes) is a direct call, `TokenizerSide`;
- the tensor-parallel worker and its model runner: `Runner` records the tensors SGLang's code
  handed it instead of loading them into a model. Its weight-update groups, their join and the
  receive of a broadcast are SGLang's model-runner methods run on it (over gloo, not NCCL);
- the tokenizer manager's own version record and `abort_request` (`TokenizerSide`); its pause
  flag is the pause it was sent (SGLang's `is_ready` and `is_healthy` read it as SGLang's own);
- the scheduler's batches: `busy` stands for running or waiting requests;
- torch_memory_saver: SGLang's own no-op adapter (`TorchMemorySaverAdapter.create(enable=False)`);
- /generate's tokens: made up, in SGLang's output format (no model ran).
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# sglang's configs import torchvision, whose compiled ops link CUDA's libraries and so do not load
# beside a CPU torch; its import then registers fake kernels for two ops nobody defined, and fails.
# Defining their schemas first (no kernels) lets it import; nothing here calls them.
if not hasattr(torch.ops.torchvision, "nms"):
    _torchvision = torch.library.Library("torchvision", "DEF")
    _torchvision.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import sglang
import uvicorn
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.entrypoints import http_server
from sglang.srt.managers import io_struct
from sglang.srt.managers.load_snapshot import LoadSnapshot
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components import weight_updater
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater as ModelWeightUpdater
from sglang.srt.runtime_context import publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

VERSION = sglang.__version__


def server_args(model_path: Path, **changed: Any) -> ServerArgs:
    """docs/sglang.md's launch command, as SGLang parses it; `changed`: other arguments."""
    launch: dict[str, Any] = dict(load_format="dummy", skip_tokenizer_init=True, enable_memory_saver=True)
    return ServerArgs(model_path=str(model_path), port=30000, device="cpu", **(launch | changed))


def resolve_model_class(config: ModelConfig) -> Any:
    """The model class SGLang would build for the folder, from its `architectures`."""
    from sglang.srt.models.registry import ModelRegistry

    model_class, _ = ModelRegistry.resolve_model_cls(config.hf_config.architectures)
    return model_class


# ---- the replaced model runner ------------------------------------------------------------------


@dataclass
class Runner:
    """Where SGLang's model runner would load weights: records what SGLang's code handed it.

    Its weight-update groups are SGLang's own: the model runner's `init_weights_update_group`,
    `destroy_weights_update_group` and `receive_weights_from_distributed` (its
    model_runner_components/weight_updater.py) run with this object as theirs, so a group is
    joined by SGLang's `init_custom_process_group` and a broadcast received into SGLang's
    `FlattenedTensorBucket.empty` over gloo, from a trainer in another process."""

    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    sessions: list[str] = field(default_factory=list)  # "begin"/"end", in order
    announced: list[dict[str, Any]] = field(default_factory=list)
    tp_rank: int = 0
    device: str = "cpu"
    _model_update_group: dict[str, Any] = field(default_factory=dict)  # SGLang's own field

    @property
    def weight_updater(self) -> Runner:
        return self

    def begin_weight_update(self) -> None:
        self.sessions.append("begin")

    def end_weight_update(self, run_post_load: bool) -> None:
        self.sessions.append("end")

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None) -> tuple[bool, str]:
        if load_format == "flattened_bucket":
            named_tensors = FlattenedTensorBucket(
                flattened_tensor=named_tensors["flattened_tensor"], metadata=named_tensors["metadata"]
            ).reconstruct_tensors()
        for name, tensor in named_tensors:
            self.loaded[name] = tensor.clone()
        return True, "Success"

    def init_weights_update_group(self, *args: Any) -> tuple[bool, str]:
        return ModelWeightUpdater.init_weights_update_group(self, *args)  # type: ignore[arg-type]

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        return ModelWeightUpdater.destroy_weights_update_group(self, group_name)  # type: ignore[arg-type]

    def receive_weights_from_distributed(self, **announced: Any) -> list[Any]:
        self.announced.append(announced)
        return ModelWeightUpdater.receive_weights_from_distributed(self, **announced)  # type: ignore[arg-type]

    def _receive_bucketed_weights_from_distributed(self, **announced: Any) -> list[Any]:
        return ModelWeightUpdater._receive_bucketed_weights_from_distributed(self, **announced)  # type: ignore[arg-type]

    def load_weights_from_distributed(self, weights: Any) -> tuple[bool, str]:
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        return True, "Succeeded to update parameter online."


class TpWorker:
    """The tensor-parallel worker (one rank), around `Runner`."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.model_runner = types.SimpleNamespace(weight_updater=runner, model=torch.nn.Linear(1, 1))

    def weight_update_runners(self) -> list[tuple[str, Runner]]:
        return [("target", self.runner)]

    def deserialize_own_rank(self, serialized_named_tensors: list[Any]) -> Any:
        """TpModelWorker.deserialize_own_rank for TP rank 0."""
        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.deserialize(serialized_named_tensors[0])

    def init_weights_update_group(self, recv_req: Any) -> tuple[bool, str]:
        """TpModelWorker's: the model runner's own method, with the request's fields."""
        r = recv_req
        return self.runner.init_weights_update_group(
            r.master_address, r.master_port, r.rank_offset, r.world_size, r.group_name, r.backend
        )

    def destroy_weights_update_group(self, recv_req: Any) -> tuple[bool, str]:
        return self.runner.destroy_weights_update_group(recv_req.group_name)


class Pools:
    """The scheduler's caches and pools that `Scheduler.flush_cache` clears: none exist here."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class SchedulerSide:
    """What SGLang's `Scheduler.flush_cache` reads of its scheduler, with `busy` as its batches."""

    def __init__(self) -> None:
        self.busy = 0
        self._engine_paused = False
        self.disaggregation_mode = weight_updater.DisaggregationMode.NULL
        self.weight_versions: list[str | None] = []
        self.tree_cache = self.req_to_token_pool = self.token_to_kv_pool_allocator = Pools()
        self.grammar_manager = self.metrics_reporter = Pools()
        self.metrics_reporter.is_stats_logging_rank = False  # type: ignore[attr-defined]
        self.draft_worker = None
        self.waiting_queue: list[Any] = []
        self.running_batch = types.SimpleNamespace(reqs=[])
        self.cur_batch_for_debug = self.last_batch = None

    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False) -> bool:
        return self.busy == 0

    def flush_cache(self, empty_cache: bool = True) -> bool:
        return Scheduler.flush_cache(self, empty_cache=empty_cache)  # type: ignore[arg-type]

    def record_weight_version_change(self, new_version: str | None) -> None:
        self.weight_versions.append(new_version)


@contextmanager
def _one_rank_group() -> Iterator[Any]:
    """A gloo group of one: the TP group SGLang's scheduler synchronizes its ranks on."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# ---- the TokenizerManager's side of the app -----------------------------------------------------


class TokenizerSide:
    """Stands where SGLang's TokenizerManager stands: the app's `_global_state.tokenizer_manager`.

    Each method does what the TokenizerManager's does before its ZMQ hop, then calls the
    scheduler's handler directly (SGLang's `SchedulerWeightUpdaterManager`, `Scheduler.flush_cache`).
    """

    is_generation = True
    gracefully_exit = False

    def __init__(self, args: ServerArgs, model_config: ModelConfig, manager: Any, scheduler: SchedulerSide) -> None:
        self.server_args, self.model_config = args, model_config
        self.model_path = self.served_model_name = args.model_path
        self.manager, self.scheduler = manager, scheduler
        self.server_status = http_server.ServerStatus.Up
        self.weight_version = "default"
        self.startup_time = time.time()
        self.paused: str | None = None
        self.requests: list[tuple[str, Any]] = []  # (route, the io_struct object SGLang parsed)
        self.served: list[tuple[str, str]] = []  # (route, the version served after it), per weight request

    def config_value(self, name: str) -> Any:
        if name == "weight_version":
            return self.weight_version
        return getattr(self.server_args, name, None)

    @property
    def is_pause(self) -> bool:
        """What SGLang's `TokenizerManager.pause_generation` sets, for every mode, until
        `continue_generation`."""
        return self.paused is not None

    def is_healthy(self) -> bool:
        return bool(TokenizerManager.is_healthy(self))  # type: ignore[arg-type]

    def is_ready(self) -> bool:
        """SGLang's own (/ready's answer): not paused, and healthy."""
        return bool(TokenizerManager.is_ready(self))  # type: ignore[arg-type]

    def _versioned(self, route: str, obj: Any, output: Any) -> tuple[bool, str]:
        """TokenizerControlMixin's `_update_weight_version_if_provided` after a successful update."""
        self.requests.append((route, obj))
        if output.success and getattr(obj, "weight_version", None) is not None:
            self.weight_version = obj.weight_version
        self.served.append((route, self.weight_version))
        return output.success, output.message

    async def update_weight_version(self, obj: Any) -> None:
        """TokenizerControlMixin.update_weight_version: the scheduler's handler (SGLang's own),
        then the tokenizer manager's record."""
        self.requests.append(("/update_weight_version", obj))
        Scheduler.handle_update_weight_version(self.scheduler, obj)  # type: ignore[arg-type]
        self.weight_version = obj.new_version
        self.served.append(("/update_weight_version", self.weight_version))

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return self._versioned("/destroy_weights_update_group", obj, self.manager.destroy_weights_update_group(obj))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.requests.append(("/abort_request", abort_all))
        if abort_all:
            self.scheduler.busy = 0

    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return self._versioned("/begin_weight_update", obj, self.manager.begin_weight_update(obj))

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return self._versioned("/end_weight_update", obj, self.manager.end_weight_update(obj))

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        from sglang.srt.managers.tokenizer_control_mixin import normalize_serialized_named_tensor_payloads

        obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        return self._versioned("/update_weights_from_tensor", obj, self.manager.update_weights_from_tensor(obj))

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        output = self.manager.update_weights_from_distributed(obj)
        return self._versioned("/update_weights_from_distributed", obj, output)

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return self._versioned("/init_weights_update_group", obj, self.manager.init_weights_update_group(obj))

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.requests.append(("/release_memory_occupation", obj))
        self.manager.release_memory_occupation(obj)

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.requests.append(("/resume_memory_occupation", obj))
        self.manager.resume_memory_occupation(obj)

    async def flush_cache(self, timeout_s: float | None = None) -> Any:
        self.requests.append(("/flush_cache", timeout_s))
        return io_struct.FlushCacheReqOutput(success=self.scheduler.flush_cache())

    async def pause_generation(self, obj: Any) -> None:
        self.requests.append(("/pause_generation", obj))
        self.paused = obj.mode

    async def continue_generation(self, obj: Any) -> None:
        self.requests.append(("/continue_generation", obj))
        self.paused = None

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{}]

    async def get_loads(self, include: Any = None, dp_rank: Any = None) -> list[LoadSnapshot]:
        return [LoadSnapshot(timestamp=time.time(), dp_rank=0, num_running_reqs=self.scheduler.busy)]

    async def generate_request(self, obj: Any, request: Any = None) -> AsyncIterator[Any]:
        """What TokenizerManager does to a request before it reaches the scheduler, then an
        answer in SGLang's output format (no model runs: the tokens are made up)."""
        self.requests.append(("/generate", obj))
        obj.normalize_batch_and_arguments()
        rows = [obj[i] for i in range(obj.batch_size)] if not obj.is_single else [obj]
        answers = []
        for row in rows:
            params = SamplingParams(**dict(row.sampling_params))
            params.normalize(None)  # --skip-tokenizer-init: no tokenizer
            params.verify(self.model_config.vocab_size)
            ids = [(sum(row.input_ids) + i) % self.model_config.vocab_size for i in range(params.max_new_tokens)]
            meta = {
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
                "finish_reason": {"type": "length", "length": len(ids)},
                "weight_version": self.weight_version,
            }
            answers.append({"output_ids": ids, "meta_info": meta})
        yield answers if not obj.is_single else answers[0]


# ---- the server ---------------------------------------------------------------------------------


@dataclass
class Served:
    url: str
    tokenizer: TokenizerSide
    scheduler: SchedulerSide
    runner: Runner
    worker: TpWorker
    args: ServerArgs
    model_config: ModelConfig


@contextmanager
def sglang_app(model_path: Path, **changed: Any) -> Iterator[Served]:
    """SGLang's app on a local port, started as docs/sglang.md starts SGLang on `model_path`
    (`changed`: other server arguments, as `server_args` takes them)."""
    args = server_args(model_path, **changed)
    publish(args, role="tokenizer")  # as SGLang's HTTP server process does at launch
    model_config = ModelConfig.from_server_args(args)
    runner, scheduler = Runner(), SchedulerSide()
    worker = TpWorker(runner)
    with _one_rank_group() as group:
        parallel = types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=group), tp_rank=0)
        model = types.SimpleNamespace(weight_cache_mode="off")
        saved = weight_updater.get_parallel, weight_updater.get_model
        weight_updater.get_parallel, weight_updater.get_model = (lambda: parallel), (lambda: model)
        try:
            manager = weight_updater.SchedulerWeightUpdaterManager(
                tp_worker=worker,
                draft_worker=None,
                memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
                flush_cache=scheduler.flush_cache,
                is_fully_idle=scheduler.is_fully_idle,
                scheduler=scheduler,
            )
            tokenizer = TokenizerSide(args, model_config, manager, scheduler)
            http_server.set_global_state(
                http_server._GlobalState(tokenizer_manager=tokenizer, template_manager=None, scheduler_info={})
            )
            config = uvicorn.Config(http_server.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
            server = uvicorn.Server(config)
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 30
            while not server.started:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError("SGLang's app did not start")
                time.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            try:
                yield Served(f"http://127.0.0.1:{port}", tokenizer, scheduler, runner, worker, args, model_config)
            finally:
                server.should_exit = True
                thread.join(10)
        finally:
            weight_updater.get_parallel, weight_updater.get_model = saved


__all__ = ["VERSION", "Served", "resolve_model_class", "server_args", "sglang_app"]
