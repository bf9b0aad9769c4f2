"""A plan for people (Rich tables) and for machines (one JSON object)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.plan.memory import GB, Plan, RankBytes
from orchestrator.plan.model import active_params, hf_params, mtp_params, padded_vocab, total_params
from orchestrator.plan.offload import PINNED_COPY_GBPS, prices

BUFFER_ROWS = (
    ("params held", "params"),
    ("bf16 param buffer", "param_buffer"),
    ("grad buffer", "grad_buffer"),
    ("fp32 mains", "mains"),
    ("Adam moments", "adam"),
    ("extras (pinned, rematerialize)", "extras"),
    ("pinned backup (backup mode)", "backup"),
)


def _gb(n: int) -> str:
    return f"{n / GB:,.2f}"


def headline(p: Plan) -> str:
    """The model and layout in one line, saying what the count includes and what it leaves out."""
    m, par = p.model, p.parallel
    included = []
    if m.mtp_num_layers:
        layers = "layer" if m.mtp_num_layers == 1 else "layers"
        included.append(f"incl. {m.mtp_num_layers} MTP {layers}: {mtp_params(m) / 1e9:,.1f} B")
    if padded_vocab(m.vocab_size, par.tp) != m.vocab_size:
        included.append(f"vocab padded {m.vocab_size:,} -> {padded_vocab(m.vocab_size, par.tp):,}")
    params = f"{total_params(m, par.tp) / 1e9:,.2f} B params" + (f" ({'; '.join(included)})" if included else "")
    if m.moe_layers:
        params += f", {active_params(m, par.tp) / 1e9:,.2f} B active"
        etp = f"ETP{par.etp}" + (" (= TP: Megatron's default)" if par.etp_is_tp else "")
        layout = f"TP{par.tp} x PP{par.pp} x DP{par.dp}, EP{par.ep} x {etp} (expert DP {par.expert_dp})"
    else:
        layout = f"TP{par.tp} x PP{par.pp} x DP{par.dp}"
    line = f"{m.name}: {params}; {layout}; {par.world} GPUs; mode {p.mode.value}; layer spec {par.spec.value}"
    notes = [f"not counted: {part}" for part in m.not_counted] + [f"assumed: {what}" for what in m.assumed]
    return "\n".join([line, *notes])


def to_json(p: Plan, *, gbps: float = PINNED_COPY_GBPS) -> dict[str, Any]:
    par, m = p.parallel, p.model
    moe = bool(m.moe_layers)
    return {
        "model": {
            "name": m.name,
            "total_params": total_params(m, par.tp),  # Megatron's: MTP and the padded vocabulary included
            "active_params": active_params(m, par.tp),
            "mtp_params": mtp_params(m),
            "hf_params": hf_params(m),  # the HF checkpoint's: no padding, no MTP
            "vocab_size": m.vocab_size,
            "padded_vocab_size": padded_vocab(m.vocab_size, par.tp),
            "not_counted": list(m.not_counted),
            "assumed": list(m.assumed),
        },
        "parallelism": {
            "tp": par.tp,
            "pp": par.pp,
            "dp": par.dp,
            "ep": par.ep,
            "etp": par.etp,
            "etp_is_tp": par.etp_is_tp,  # not given: TP, Megatron's default
            "expert_dp": par.expert_dp if moe else None,
            "world": par.world,
            "pp_layers": [len(s) for s in par.stages(m)],
            "layer_spec": par.spec.value,
        },
        "optimizer": {
            "distributed": p.optimizer.distributed,
            "grad_dtype": p.optimizer.grad_dtype.value,
            "adam": p.optimizer.adam,
        },
        "mode": p.mode.value,
        "engine": {
            "weights_per_gpu": p.engine_weights,
            "kv_cache_per_gpu": p.kv_cache,
            "kv_bytes_per_token": p.kv_token_bytes,
        },
        "offload": {"policy": p.offload.value, "pinned_copy_gbps": gbps},
        "stages": [_stage_json(p, r, gbps) for r in p.ranks],
        "checkpoint": _checkpoint_json(p),
        "nodes": [{"node": n, "device_peak": d, "host_peak": h} for n, d, h in p.node_totals()],
        "gpus_per_node": p.gpus_per_node,
    }


def _checkpoint_json(p: Plan) -> dict[str, Any]:
    model, optimizer = p.checkpoint_bytes()
    return {
        "total": model + optimizer,
        "model": model,  # each tensor once
        "optimizer": optimizer,  # every rank's shard
        "per_rank": [  # the busiest rank of each stage
            {
                "stage": r.stage,
                "model_shard": r.model_shard,
                "optimizer_shard": r.optimizer_shard,
                "written": p.checkpoint_written(r),
                "host_for_save": p.checkpoint_written(r),  # the writer stages all of it in host memory
            }
            for r in p.ranks
        ],
    }


def _stage_json(p: Plan, r: RankBytes, gbps: float) -> dict[str, Any]:
    return {
        "stage": r.stage,
        "layers": r.layers,
        **{key: getattr(r, key) for _, key in BUFFER_ROWS},
        "phases": {name: {"device": d, "host": h} for name, (d, h) in p.phases(r).items()},
        "offload": {
            x.region.value: {
                "bytes": x.bytes,
                "stays": x.stays,
                "copied_each_way": x.copied,
                "move_seconds_per_step": x.move_s,
                "kv_tokens_given_up": x.kv_tokens,
            }
            for x in prices(p, r, gbps=gbps)
        },
        "offload_spare": p.residency[r.stage].spare if p.residency else None,
    }


def show_offload(p: Plan, console: Console, *, gbps: float = PINNED_COPY_GBPS) -> None:
    """Per stage and region: the choice, and its price both ways."""
    table = Table(
        title=f"--offload {p.offload.value}: which regions leave the GPU for the rollout, per rank "
        f"(moving: pinned copies at {gbps:g} GB/s each way; staying: KV tokens per engine GPU "
        f"at {p.kv_token_bytes:,} bytes a token)"
    )
    for col, justify in (("stage", "right"), ("region", "left"), ("GB", "right"), ("choice", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    table.add_column("move: s per step", justify="right")
    table.add_column("stay: KV tokens given up", justify="right")
    for r in p.ranks:
        for x in prices(p, r, gbps=gbps):
            choice = "moves (drop_params)" if not x.choosable else "stays" if x.stays else "moves"
            table.add_row(str(r.stage), x.region.value, _gb(x.bytes), choice, f"{x.move_s:.3f}", f"{x.kv_tokens:,}")
    console.print(table)
    spare = [res.spare for res in p.residency if res.spare is not None]
    if spare:
        console.print(
            f"tightest point of a sleep leaves {_gb(min(spare))} GB of a {_gb(p.engine.device_bytes)} GB GPU free"
        )


def show_checkpoint(p: Plan, console: Console) -> None:
    """What one save writes from the busiest rank of each stage, and in all."""
    table = Table(
        title="checkpoint: what one save writes from the busiest rank of each stage, GB (the writer "
        "copies it all to host memory first)"
    )
    table.add_column("")
    for r in p.ranks:
        table.add_column(f"stage {r.stage}", justify="right")
    table.add_row("model shard (one DP replica)", *(_gb(r.model_shard) for r in p.ranks))
    table.add_row("optimizer shard (fp32 state)", *(_gb(r.optimizer_shard) for r in p.ranks))
    table.add_row("written (host memory, at most)", *(_gb(p.checkpoint_written(r)) for r in p.ranks))
    console.print(table)
    model, optimizer = p.checkpoint_bytes()
    console.print(
        f"checkpoint in all: {_gb(model + optimizer)} GB (the model once: {_gb(model)} GB; "
        f"the optimizer state of all {p.parallel.world} ranks: {_gb(optimizer)} GB)"
    )


def show(p: Plan, console: Console, *, gbps: float = PINNED_COPY_GBPS) -> None:
    console.print(headline(p), markup=False, highlight=False)
    per_rank = Table(title="per rank of each stage (GB; params in billions)")
    per_rank.add_column("")
    for r in p.ranks:
        per_rank.add_column(f"stage {r.stage} ({r.layers} layers)", justify="right")
    for label, key in BUFFER_ROWS:
        scale = 1e9 if key == "params" else GB
        per_rank.add_row(label, *(f"{getattr(r, key) / scale:,.2f}" for r in p.ranks))
    console.print(per_rank)
    phases = Table(title="device / host (pinned) peak per rank and phase, GB (activations not counted)")
    phases.add_column("phase")
    for r in p.ranks:
        phases.add_column(f"stage {r.stage} device", justify="right")
        phases.add_column(f"stage {r.stage} host", justify="right")
    by_stage = [p.phases(r) for r in p.ranks]
    for name in by_stage[0]:
        phases.add_row(name, *(_gb(x) for s in by_stage for x in s[name]))
    console.print(phases)
    console.print(
        f"engine per GPU: weights {_gb(p.engine_weights)} GB, KV cache {_gb(p.kv_cache)} GB "
        f"(mem_fraction_static {p.engine.mem_fraction_static} of {_gb(p.engine.device_bytes)} GB), "
        f"CUDA graphs {_gb(p.engine.cuda_graph_bytes)} GB"
    )
    show_offload(p, console, gbps=gbps)
    show_checkpoint(p, console)
    nodes = Table(title=f"per node of {p.gpus_per_node} GPUs, peak over phases (GB)")
    for col in ("node", "device", "host (pinned)"):
        nodes.add_column(col, justify="right")
    for n, d, h in p.node_totals():
        nodes.add_row(str(n), _gb(d), _gb(h))
    console.print(nodes)
