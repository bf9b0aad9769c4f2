"""gloo ranks for the one-call embedding at TP=2 and PP=2: real megatron-core (Megatron's own block
spec, DDP, DistributedOptimizer) on the CPU path, and one real transformers engine that every rank
reaches, as the TP ranks of a trainer all reach one SGLang server.

The engine lives in rank 0's process. The other ranks hold a handle on it, served over a
`multiprocessing` manager connection: it reads the engine's version and idleness, sends weight
buckets (counted on that rank), and leaves the engine's memory to rank 0's lifecycle, since a
server's memory is released once, not once per rank. The engine counts every tensor it receives,
from any rank, per version.
"""

from __future__ import annotations

import io
import json
import os
import threading
import traceback
from collections import Counter
from collections.abc import Sequence
from functools import partial
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any

import torch

from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.errors import EngineError
from orchestrator.protocols import EngineDefaults, Named
from states import EngineMemory
from tests.support.megatron_parallel import train_step as _train_step

CYCLES = 2  # then, at TP=2, a failed update, a recovery and one more cycle
AUTHKEY = b"colocate-embed-parallel"


class SharedEngine(TransformersEngine):
    """The engine every rank sends to: one lock around loading (two pipeline stages may send at
    once), and the names and bucket sizes it received, per version."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self.received: dict[int, Counter[str]] = {}
        self.bucket_bytes: dict[int, list[int]] = {}  # per version, each bucket's bytes as sent
        self.fail_next = False  # refuse the next bucket, as a server that ran out of memory would

    def update_weights(self, named: Sequence[tuple[str, torch.Tensor]], version: int) -> int:
        with self._lock:
            if self.fail_next:
                self.fail_next = False
                raise EngineError(self.name, "update_weights_from_tensor failed (injected)")
            self.received.setdefault(version, Counter()).update(name for name, _ in named)
            self.bucket_bytes.setdefault(version, []).append(sum(t.numel() * t.element_size() for _, t in named))
            return super().update_weights(named, version)

    def update_weights_saved(self, blob: bytes, version: int) -> int:
        """A bucket another rank sent, as `torch.save` wrote it."""
        return self.update_weights(torch.load(io.BytesIO(blob)), version)


class RemoteEngine(EngineDefaults):
    """Another rank's handle on rank 0's `SharedEngine` (see the module docstring)."""

    def __init__(self, proxy: Any) -> None:
        self._proxy, self.name, self.sent = proxy, "transformers@rank0", 0
        self._released: frozenset[EngineMemory] = frozenset()

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self._released |= tags  # rank 0's lifecycle releases the engine: this handle only says so

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self._released -= tags

    def released(self) -> frozenset[EngineMemory]:
        """What this handle was told: rank 0's lifecycle moves the memory, so this rank's recover
        never waits on another rank's."""
        return self._released

    def flush_cache(self) -> None:
        pass

    def weight_version(self) -> int | None:
        return self._proxy.weight_version()

    def is_idle(self) -> bool:
        return self._proxy.is_idle()

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        self.sent += len(named)
        blob = io.BytesIO()
        torch.save([(name, tensor.contiguous()) for name, tensor in named], blob)
        return self._proxy.update_weights_saved(blob.getvalue(), version)


class _Manager(BaseManager):
    pass


def _share(engine: SharedEngine) -> tuple[str, int]:
    """Serve `engine` from this process; the address the other ranks connect to."""
    _Manager.register("engine", callable=lambda: engine)
    server = _Manager(address=("127.0.0.1", 0), authkey=AUTHKEY).get_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.address


def _connect(address: tuple[str, int]) -> RemoteEngine:
    _Manager.register("engine")
    manager = _Manager(address=tuple(address), authkey=AUTHKEY)
    manager.connect()
    return RemoteEngine(manager.engine())  # type: ignore[attr-defined]


def _generate_then_wait(engine: SharedEngine, prompts: torch.Tensor, seed: int) -> None:
    engine.generate(prompts, max_new_tokens=4, temperature=1.0, seed=seed)
    torch.distributed.barrier()  # the other ranks restore once the engine is idle


def _synced_digests(chunks: list[Any]) -> dict[str, str]:
    """The trainer's params gathered and converted to HF, apart from the sync (every rank calls
    it: the gathers are collectives), as this rank's source share: SHA256 per HF tensor."""
    from orchestrator.adapters.digest import sha256_digests
    from orchestrator.adapters.megatron.convert import hf_buckets, is_sync_source

    whole = {name: tensor for bucket in hf_buckets(chunks, bucket_bytes=1 << 30) for name, tensor in bucket}
    return sha256_digests({n: t.contiguous() for n, t in whole.items()}) if is_sync_source() else {}


def _cycle(
    lifecycle: Any,
    engine: SharedEngine | RemoteEngine,
    chunks: list[Any],
    optimizer: Any,
    batches: list[Any],
    step: int,
) -> dict[str, Any]:
    """One step through the lifecycle; on rank 0, whether the engine held exactly the trainer's
    params, gathered and converted apart from the sync, once the update was done."""
    with lifecycle.step():
        lifecycle.pause_grads()
        lifecycle.update_weights()
        served = engine.digests() if isinstance(engine, SharedEngine) else {}  # every source has sent
        mine = _synced_digests(chunks)
        rank = torch.distributed.get_rank()
        shares: list[Any] = [None] * torch.distributed.get_world_size() if rank == 0 else []
        torch.distributed.gather_object(mine, shares if rank == 0 else None, dst=0)
        lifecycle.drop_params()
        if isinstance(engine, SharedEngine):
            lifecycle.rollout(partial(_generate_then_wait, engine, batches[step][:, :4], step))
        else:
            lifecycle.rollout(torch.distributed.barrier)  # this rank waits out rank 0's rollout
        lifecycle.restore()
        lifecycle.train(partial(_train_step, chunks, optimizer, batches[step + 1]))
    report: dict[str, Any] = {"verified": lifecycle.last_restore_verified, "version": lifecycle.weight_version}
    if rank == 0:
        expected: dict[str, str] = {}
        for share in shares:
            overlap = expected.keys() & share.keys()
            assert not overlap, f"two sources converted {sorted(overlap)}"
            expected |= share
        report["engine_equals_trainer"] = served == expected
        report["differ"] = sorted(n for n in served.keys() | expected.keys() if served.get(n) != expected.get(n))
    return report


def embed_parallel_scenario(rank: int, tp: int, pp: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from orchestrator import ActionFailed, colocate_megatron
    from orchestrator.adapters.megatron.convert import Family, is_sync_source
    from orchestrator.adapters.megatron.embed import gpt_shape
    from tests.support.megatron_parallel import SEQ, batches, build

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    chunks, optimizer = build(Family.LLAMA, tp, pp, 1)
    inputs = batches(CYCLES + 2)
    _train_step(chunks, optimizer, inputs[0])

    engine: SharedEngine | RemoteEngine
    if rank == 0:
        engine = SharedEngine(gpt_shape(chunks), max_batch=4, max_len=SEQ)
        address = [_share(engine)]
    else:
        address = [None]
    torch.distributed.broadcast_object_list(address, src=0)
    if rank != 0:
        engine = _connect(address[0])

    lifecycle = colocate_megatron(chunks, optimizer, engine)  # the default converter: hf_buckets
    result: dict[str, Any] = {"source": is_sync_source(), "cycles": []}
    cycle = partial(_cycle, lifecycle, engine, chunks, optimizer, inputs)
    result["cycles"] = [cycle(step) for step in range(CYCLES)]
    if tp > 1:
        # The bad day: the engine refuses rank 0's first bucket. TP rank 1 sends nothing, yet its
        # update fails with rank 0's; both recover, and the next cycle syncs the whole model.
        if isinstance(engine, SharedEngine):
            engine.fail_next = True
        lifecycle.pause_grads()
        failed: dict[str, Any] = {}
        try:
            lifecycle.update_weights()
        except ActionFailed as error:
            failed = {"cause": type(error.__cause__).__name__, "message": str(error.__cause__)}
        failed |= {"phase": lifecycle.phase.value, "engine_version": engine.weight_version()}
        lifecycle.recover()
        failed["recovered"] = lifecycle.phase.value
        result["failed"] = failed
        result["cycles"].append(cycle(CYCLES))
    if rank == 0:
        assert isinstance(engine, SharedEngine)
        result["received"] = {str(v): dict(c) for v, c in engine.received.items()}
        result["engine_params"] = sorted(engine._params)
    else:
        assert isinstance(engine, RemoteEngine)
        result["sent"] = engine.sent
    torch.distributed.barrier()  # rank 0 serves the engine until every rank is done with it
    return result


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}  # name: (tensor-, pipeline-parallel size), on 2 ranks


def rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    """Every layout in turn in one process pair (a spawn costs more than a layout)."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # this spawned process only
    path = Path(out) / f"rank{rank}.json"
    try:
        from megatron.core import parallel_state as ps

        from orchestrator.adapters.megatron.cpu import enable_cpu_path

        enable_cpu_path()
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        result = {}
        for name, (tp, pp) in LAYOUTS.items():
            result[name] = embed_parallel_scenario(rank, tp, pp)
            ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    except BaseException:
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    path.write_text(json.dumps(result))
