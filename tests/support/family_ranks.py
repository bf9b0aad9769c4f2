"""gloo ranks for the whole-path test of every family (tests/integration/test_families.py).

One spawn per layout builds each family in turn (tests/support/megatron_parallel.py: Megatron's
own block spec and GPTModel in Float16Module, DDP and the DistributedOptimizer) and runs it
through `colocate_megatron` against one transformers engine built for that family
(`TransformersEngine(gpt_shape(model))`: transformers' own class, from the converter's
`hf_config`), living in rank 0's process and reached by the other ranks over a `multiprocessing`
manager connection, as the ranks of a trainer all reach one SGLang server
(tests/support/embed_parallel_ranks.py).

Each of `CYCLES` cycles is one colocated step, as the state table orders it: a train step through
Megatron's schedule, pause_grads, update_weights (watched: the peak extra memory and the
all-gathers of the sync), drop_params, a rollout in which the engine computes its logits of
held-out tokens, a restore the lifecycle verifies bit-identical (every cycle: verify_cycles =
`CYCLES`), and Megatron's logits of the same tokens from the restored params. What the ranks
return, the test judges.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
import weakref
from functools import partial
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.embed_parallel_ranks import AUTHKEY, RemoteEngine, SharedEngine

CYCLES = 3
BUCKET_BYTES = 40 << 10  # above the largest tensor of the tiny models, well below a stage's params

# name: (tensor-, pipeline-, expert-parallel size, world size). An MoE model's experts are
# tensor-parallel where EP is 1 (expert TP = TP: "tp2"), else not (expert TP 1: in "tp2pp2ep2"
# their expert-parallel group is the dense TP group).
LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "tp2": (2, 1, 1, 2),
    "pp2": (1, 2, 1, 2),
    "ep2": (1, 1, 2, 2),
    "tp2pp2ep2": (2, 2, 2, 4),
}


class SyncWatch(TorchDispatchMode):
    """While on, in this thread: the bytes of the tensors made and still alive (every op's new
    storage counts from the op until it is freed, on whichever thread drops it), `peak` the most
    at once, and `gathers` the all-gathers. Storages an op shares with its inputs (views, in-place
    ops, `detach`) are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.held = self.peak = self.gathers = 0
        self._live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.held -= self._live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.gathers += str(func).startswith("c10d.allgather")
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._live or not storage.nbytes():
                continue
            self._live[key] = storage.nbytes()
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
            weakref.finalize(storage, self._free, key)
        return out


class _Host(BaseManager):
    pass


class EngineHost:
    """The current family's engine: built and served by rank 0, reached by the others."""

    def __init__(self, rank: int) -> None:
        self.rank, self._current = rank, [None]
        address: list[Any] = [None]
        if rank == 0:
            _Host.register("engine", callable=lambda: self._current[0])
            server = _Host(address=("127.0.0.1", 0), authkey=AUTHKEY).get_server()
            threading.Thread(target=server.serve_forever, daemon=True).start()
            address = [server.address]
        torch.distributed.broadcast_object_list(address, src=0)
        if rank != 0:
            _Host.register("engine")
            self._manager = _Host(address=tuple(address[0]), authkey=AUTHKEY)
            self._manager.connect()

    def engine(self, spec: Any) -> SharedEngine | RemoteEngine:
        """Every rank calls it: rank 0 builds the family's engine, then the others connect to it."""
        from tests.support.megatron_parallel import BATCH, SEQ

        if self.rank == 0:
            self._current[0] = SharedEngine(spec, max_batch=BATCH, max_len=SEQ)
        torch.distributed.barrier()
        return self._current[0] if self.rank == 0 else RemoteEngine(self._manager.engine())  # type: ignore[attr-defined,return-value]


def _expert_biases(chunks: list[Any]) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for c in chunks for n, b in c.named_buffers() if n.endswith("expert_bias")}


def _serve(engine: SharedEngine | RemoteEngine, tokens: torch.Tensor) -> dict[str, Any] | None:
    """The rollout: rank 0's engine computes its logits of `tokens` with the weights it was sent."""
    served = None
    if isinstance(engine, SharedEngine):
        served = {"logits": engine.logits(tokens), "weights": engine.weights()}
    torch.distributed.barrier()  # the other ranks restore once the engine is idle
    return served


def _cycle(
    lifecycle: Any, engine: Any, chunks: list[Any], optimizer: Any, batch: torch.Tensor, held_out: torch.Tensor
) -> tuple[dict[str, Any], dict[str, Any] | None, torch.Tensor | None]:
    """One colocated step; its report, what the engine served (rank 0), Megatron's logits."""
    from tests.support.megatron_parallel import logits, train_step

    with lifecycle.step():
        before = _expert_biases(chunks)
        lifecycle.train(partial(train_step, chunks, optimizer, batch))
        after = _expert_biases(chunks)
        lifecycle.pause_grads()
        with SyncWatch() as watch:
            lifecycle.update_weights()
        lifecycle.drop_params()
        served = lifecycle.rollout(partial(_serve, engine, held_out[:, :-1]))
        lifecycle.restore()
    report = {
        "verified": lifecycle.last_restore_verified,
        "version": lifecycle.weight_version,
        "peak_extra_bytes": watch.peak,
        "gathers": watch.gathers,
        "expert_bias_held": len(before),
        "expert_bias_moved": sum(not torch.equal(before[n], after[n]) for n in before),
    }
    return report, served, logits(chunks, held_out)  # Megatron's, from the restored params


def _sharded(chunks: list[Any]) -> tuple[int, int]:
    """How many of this rank's tensors other ranks hold parts of (plus the one exchange of expert
    ranks an MoE model's sync starts with), and the bytes of the largest whole tensor one makes."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    experts = ps.get_expert_tensor_and_model_parallel_world_size()
    count, largest = int(bool(chunks[0].config.num_moe_experts)), 0
    for name, param in chunks[0].named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            count += experts > 1
            largest = max(largest, size * experts)
        else:
            split = tp > 1 and bool(getattr(param, "tensor_model_parallel", False))
            count += split
            largest = max(largest, size * (tp if split else 1))
    return count, largest


def family_scenario(rank: int, family: Any, layout: tuple[int, int, int], host: EngineHost) -> tuple[dict, dict]:
    """One family through `CYCLES` colocated steps; this rank's report and tensors."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from orchestrator import colocate_megatron
    from orchestrator.adapters.megatron.convert import is_sync_source, model_spec
    from orchestrator.adapters.megatron.embed import gpt_shape
    from states import Source
    from tests.support.megatron_parallel import batches, build

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    chunks, optimizer = build(family, *layout)
    engine = host.engine(gpt_shape(chunks))
    lifecycle = colocate_megatron(chunks, optimizer, engine, bucket_bytes=BUCKET_BYTES, verify_cycles=CYCLES)
    inputs = batches(CYCLES + 1)  # the last one held out: the model never trains on it
    sharded, largest = _sharded(chunks)
    sources = lifecycle.snapshot().layout.sync_sources
    report: dict[str, Any] = {
        "spec": model_spec(chunks).to_dict(),
        "source": is_sync_source(),
        "sharded": sharded,
        "largest_whole": largest,
        "expert_bias": bool(chunks[0].config.moe_router_enable_expert_bias),
        "expert_bias_sources": {n: s.value for n, s in sources.items() if n.endswith("expert_bias")},
        "extras": sorted(n for n, s in sources.items() if s is Source.EXTRAS),
        "cycles": [],
    }
    tensors: dict[str, Any] = {"tokens": inputs[-1][:, :-1], "megatron": [], "engine": [], "weights": None}
    last_stage_source = ps.is_pipeline_last_stage() and is_sync_source()
    for step in range(CYCLES):
        cycle, served, megatron = _cycle(lifecycle, engine, chunks, optimizer, inputs[step], inputs[-1])
        report["cycles"].append(cycle)
        tensors["megatron"].append(megatron if last_stage_source else None)
        if served is not None:
            tensors["engine"].append(served["logits"])
            tensors["weights"] = served["weights"]
    if isinstance(engine, SharedEngine):
        report["engine_class"] = type(engine.model).__name__
        report["received"] = {str(v): dict(c) for v, c in engine.received.items()}
        report["bucket_bytes"] = {str(v): b for v, b in engine.bucket_bytes.items()}
    torch.distributed.barrier()  # rank 0 serves this engine until every rank is done with it
    return report, tensors


def rank_main(rank: int, world: int, port: int, out: str, layout: str, families: list[str]) -> None:
    """Every family of `families` in turn at `layout` (a spawn costs more than a family)."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # this spawned process only: the router's compile costs 9 s
    result: dict[str, Any] = {}
    try:
        from megatron.core import parallel_state as ps

        from orchestrator.adapters.megatron.convert import Family
        from orchestrator.adapters.megatron.cpu import enable_cpu_path

        enable_cpu_path()
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        tp, pp, ep, _ = LAYOUTS[layout]
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp if ep == 1 else 1,
        )
        host = EngineHost(rank)
        tensors = {}
        for family in families:
            start = time.perf_counter()
            result[family], tensors[family] = family_scenario(rank, Family(family), (tp, pp, ep), host)
            result[family]["seconds"] = round(time.perf_counter() - start, 2)
        torch.save(tensors, Path(out) / f"rank{rank}.pt")
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    except BaseException:
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
