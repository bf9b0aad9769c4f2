"""Ranks for the whole-path test of every case (tests/integration/test_families.py), on the CPU
(gloo) or on CUDA (nccl: tests/gpu/test_families_gpu.py).

One spawn per layout builds each case of `CASES` in turn (tests/support/megatron_parallel.py:
Megatron's own block spec and GPTModel in Float16Module, DDP and the DistributedOptimizer) and runs
it through `colocate_megatron` against one transformers engine built for it
(`TransformersEngine(gpt_shape(model))`: transformers' own class, from the converter's
`hf_config`), living in rank 0's process and reached by the other ranks over a `multiprocessing`
manager connection, as the ranks of a trainer all reach one SGLang server
(tests/support/embed_parallel_ranks.py).

Each of `CYCLES` cycles is one colocated step, as the state table orders it: a train step through
Megatron's schedule, pause_grads, update_weights (watched: the peak extra memory and the
all-gathers of the sync), drop_params, a rollout in which the engine computes its logits of
held-out tokens, a restore the lifecycle verifies bit-identical (every cycle: verify_cycles =
`CYCLES`), and Megatron's logits of the same tokens from the restored params. Both sides record
each router's chosen experts and each DSA indexer's chosen keys on the way (tests/support/routing.py).
A model with MTP layers is synced once more at the end with `hf_buckets(..., mtp=True)`, which
the lifecycle's sync leaves out. What the ranks return, the test judges.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from dataclasses import asdict
from functools import partial
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any

import torch

from orchestrator.adapters.megatron.convert import Family
from tests.support.embed_parallel_ranks import AUTHKEY, RemoteEngine, SharedEngine
from tests.support.rounding import logit_spread
from tests.support.routing import hf_routing, hf_selections, megatron_routing
from tests.support.sync_watch import SyncWatch
from tests.support.tolerance import own_rounding

CYCLES = 3
BUCKET_BYTES = 40 << 10  # above the largest tensor of the tiny models, well below a stage's params

# name: (family, build options). Qwen3 with tied embeddings (as Qwen3-4B; Llama keeps its output
# layer), Mixtral with GroupedMLP experts (Qwen3-MoE keeps SequentialMLP's).
CASES: dict[str, tuple[Family, dict[str, bool]]] = {
    "llama": (Family.LLAMA, {}),
    "qwen3 tied": (Family.QWEN3, {"tied": True}),
    "qwen3_moe": (Family.QWEN3_MOE, {}),
    "mixtral grouped": (Family.MIXTRAL, {"grouped_gemm": True}),
    "deepseek_v3": (Family.DEEPSEEK_V3, {}),
    "glm4_moe": (Family.GLM4_MOE, {}),
    "glm_moe_dsa": (Family.GLM_MOE_DSA, {}),
}

# name: (tensor-, pipeline-, expert-parallel size, world size). An MoE model's experts are
# tensor-parallel where EP is 1 (expert TP = TP: "tp2"), else not (expert TP 1: in "tp2pp2ep2"
# their expert-parallel group is the dense TP group). "one": one GPU (tests/gpu).
LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "tp2": (2, 1, 1, 2),
    "pp2": (1, 2, 1, 2),
    "ep2": (1, 1, 2, 2),
    "tp2pp2ep2": (2, 2, 2, 4),
    "one": (1, 1, 1, 1),
}


class _Host(BaseManager):
    pass


class EngineHost:
    """The current case's engine: built and served by rank 0, reached by the others."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self._current = rank, world, [None]
        address: list[Any] = [None]
        if rank == 0 and world > 1:
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
        """Every rank calls it: rank 0 builds the case's engine, then the others connect to it."""
        from tests.support.megatron_parallel import BATCH, SEQ

        if self.rank == 0:
            self._current[0] = SharedEngine(spec, max_batch=BATCH, max_len=SEQ)
        torch.distributed.barrier()
        return self._current[0] if self.rank == 0 else RemoteEngine(self._manager.engine())  # type: ignore[attr-defined,return-value]


def _expert_biases(chunks: list[Any]) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for c in chunks for n, b in c.named_buffers() if n.endswith("expert_bias")}


def _cpu(tree: Any) -> Any:
    """`tree` (tensors in dicts and lists) with every tensor on the host, for `torch.save`."""
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return [_cpu(v) for v in tree] if isinstance(tree, list) else tree.detach().cpu()


def _serve(engine: SharedEngine | RemoteEngine, tokens: torch.Tensor) -> dict[str, Any] | None:
    """The rollout: rank 0's engine computes its logits of `tokens` with the weights it was sent,
    recording which experts its routers and which keys its indexers chose."""
    served = None
    if isinstance(engine, SharedEngine):
        with (
            hf_routing(engine.model, batch=tokens.shape[0]) as routing,
            hf_selections(engine.model) as keys,
            logit_spread(engine.model) as spreads,
        ):
            logits = engine.logits(tokens)
        served = {"logits": logits, "spread": spreads[0], "routing": routing, "keys": keys, "weights": engine.weights()}
        served = _cpu(served)
        topk = getattr(engine.model.config, "index_topk", 0) or 0
        served["own"] = own_rounding(engine.model, tokens, (served["logits"], served["routing"], served["keys"]), topk)
    torch.distributed.barrier()  # the other ranks restore once the engine is idle
    return served


def _megatron(chunks: list[Any], held_out: torch.Tensor) -> tuple[Any, dict, dict]:
    """Megatron's logits (a dict with each MTP layer's too, where it has them; None off the last
    stage), and this stage's routing and DSA selections."""
    from orchestrator.adapters.megatron.convert.gather import unwrap_gpt
    from tests.support.megatron_dsa import recorded_selections
    from tests.support.megatron_parallel import logits

    with megatron_routing(chunks) as routing, recorded_selections(unwrap_gpt(chunks[0])) as keys:
        out = logits(chunks, held_out)
    return (None if out is None else _cpu(out)), _cpu(routing), _cpu(keys)


def _cycle(
    lifecycle: Any, engine: Any, chunks: list[Any], optimizer: Any, batch: torch.Tensor, held_out: torch.Tensor
) -> tuple[dict[str, Any], dict[str, Any] | None, tuple[Any, dict, dict]]:
    """One colocated step; its report, what the engine served (rank 0), Megatron's side."""
    from tests.support.megatron_parallel import train_step

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
    return report, served, _megatron(chunks, held_out)  # Megatron's, from the restored params


def _sharded(chunks: list[Any]) -> tuple[int, int]:
    """How many of this rank's tensors other ranks hold parts of (plus the one exchange of expert
    ranks an MoE model's sync starts with; a GroupedMLP weight counts once per local expert; the
    MTP layers, their stage's embedding copy and a tied output layer are not sent), and the bytes
    of the largest whole tensor one makes."""
    from megatron.core import parallel_state as ps

    from orchestrator.adapters.megatron.convert.gather import unwrap_gpt

    config, gpt = chunks[0].config, unwrap_gpt(chunks[0])
    tp = ps.get_tensor_model_parallel_world_size()
    experts = ps.get_expert_tensor_and_model_parallel_world_size()
    local = (config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    count, largest = int(bool(config.num_moe_experts)), 0
    for name, param in gpt.named_parameters():
        size = param.numel() * param.element_size()
        if name.startswith("mtp.") or (name.startswith("embedding.") and not ps.is_pipeline_first_stage()):
            continue
        if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
            continue
        if ".experts.weight" in name:  # GroupedMLP: every local expert's block on its own
            count += (experts > 1) * local
            largest = max(largest, size // local * experts)
        elif ".experts." in name:
            count += experts > 1
            largest = max(largest, size * experts)
        else:
            split = tp > 1 and bool(getattr(param, "tensor_model_parallel", False))
            count += split
            largest = max(largest, size * (tp if split else 1))
    return count, largest


def _mtp_sync(chunks: list[Any]) -> dict[str, torch.Tensor]:
    """The sync with the MTP layers (`hf_buckets(..., mtp=True)`), this source rank's share."""
    from orchestrator.adapters.megatron.convert import hf_buckets, is_sync_source

    state: dict[str, torch.Tensor] = {}
    for bucket in hf_buckets(chunks, bucket_bytes=BUCKET_BYTES, mtp=True):
        state.update(_cpu(dict(bucket)))
    return state if is_sync_source() else {}


def case_scenario(rank: int, case: str, layout: tuple[int, int, int], host: EngineHost, device: str) -> tuple:
    """One case through `CYCLES` colocated steps; this rank's report and tensors."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from orchestrator import Sync, Verify, colocate_megatron
    from orchestrator.adapters.megatron.convert import is_sync_source, left_out, model_spec
    from orchestrator.adapters.megatron.convert.gather import unwrap_gpt
    from orchestrator.adapters.megatron.embed import gpt_shape
    from states import Source
    from tests.support.hf_glm5 import first_indexer_against_hf
    from tests.support.megatron_parallel import batches, build

    family, options = CASES[case]
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    chunks, optimizer = build(family, *layout, **options, device=device)
    engine = host.engine(gpt_shape(chunks))
    lifecycle = colocate_megatron(
        chunks, optimizer, engine, sync=Sync(bucket_bytes=BUCKET_BYTES), verify=Verify(cycles=CYCLES)
    )
    inputs = [b.to(device) for b in batches(CYCLES + 1)]  # the last one held out: never trained on
    sharded, largest = _sharded(chunks)
    sources = lifecycle.snapshot().layout.sync_sources
    source = is_sync_source()
    report: dict[str, Any] = {
        "spec": asdict(model_spec(chunks)),
        "source": source,
        "sharded": sharded,
        "largest_whole": largest,
        "left_out": left_out(chunks),
        "expert_bias": bool(chunks[0].config.moe_router_enable_expert_bias),
        "expert_bias_sources": {n: s.value for n, s in sources.items() if n.endswith("expert_bias")},
        "extras": sorted(n for n, s in sources.items() if s is Source.EXTRAS),
        "cycles": [],
    }
    keys = (
        *("megatron", "mtp", "routing", "selections"),
        *("engine", "engine_spread", "engine_own", "engine_routing", "engine_keys"),
    )
    tensors: dict[str, Any] = {"tokens": inputs[-1][:, :-1].cpu(), **{k: [] for k in keys}, "weights": None}
    last_stage_source = ps.is_pipeline_last_stage() and source
    for step in range(CYCLES):
        cycle, served, (logits, routing, selections) = _cycle(
            lifecycle, engine, chunks, optimizer, inputs[step], inputs[-1]
        )
        report["cycles"].append(cycle)
        mtp = logits.pop("mtp")[0] if isinstance(logits, dict) else None
        logits = logits["logits"] if isinstance(logits, dict) else logits
        tensors["megatron"].append(logits if last_stage_source else None)
        tensors["mtp"].append(mtp if last_stage_source else None)
        tensors["routing"].append(routing if source else {})
        tensors["selections"].append(selections if source else {})
        if served is not None:
            tensors["engine"].append(served["logits"])
            tensors["engine_spread"].append(served["spread"])
            tensors["engine_own"].append(served["own"])
            tensors["engine_routing"].append(served["routing"])
            tensors["engine_keys"].append(served["keys"])
            tensors["weights"] = served["weights"]
    if isinstance(engine, SharedEngine):
        report["engine_class"] = type(engine.model).__name__
        report["received"] = {str(v): dict(c) for v, c in engine.received.items()}
        report["bucket_bytes"] = {str(v): b for v, b in engine.bucket_bytes.items()}
    if chunks[0].config.mtp_num_layers:
        tensors["mtp_state"] = _mtp_sync(chunks)
    if family is Family.GLM_MOE_DSA and source:  # a stage's first (trained) indexer on random queries
        report["indexer"] = first_indexer_against_hf(unwrap_gpt(chunks[0]))
    torch.distributed.barrier()  # rank 0 serves this engine until every rank is done with it
    return report, tensors


def _init(rank: int, world: int, port: int, layout: str, device: str) -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    if device == "cpu":
        from orchestrator.adapters.megatron.cpu import enable_cpu_path

        enable_cpu_path()
    else:
        torch.cuda.set_device(rank)
    backend = "gloo" if device == "cpu" else "nccl"
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp, pp, ep, _ = LAYOUTS[layout]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if ep == 1 else 1,
    )
    return tp, pp, ep


def rank_main(rank: int, world: int, port: int, out: str, layout: str, cases: list[str], device: str = "cpu") -> None:
    """Every case of `cases` in turn at `layout` (a spawn costs more than a case), on `device`
    ("cpu": gloo and the CPU path; "cuda": nccl, one GPU a rank)."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # this spawned process only: the router's compile costs 9 s
    result: dict[str, Any] = {}
    try:
        from megatron.core import parallel_state as ps

        parallel = _init(rank, world, port, layout, device)
        host = EngineHost(rank, world)
        tensors = {}
        for case in cases:
            start = time.perf_counter()
            result[case], tensors[case] = case_scenario(rank, case, parallel, host, device)
            result[case]["seconds"] = round(time.perf_counter() - start, 2)
        torch.save(tensors, Path(out) / f"rank{rank}.pt")
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    except BaseException:
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
