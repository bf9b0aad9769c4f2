"""`colocate plan`: the bytes of every rank and phase, before anything is launched."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.cli.plan import options as o
from orchestrator.cli.plan.show import show, to_json
from orchestrator.cli.plan.times import show_timing, timing_json
from orchestrator.errors import ConfigError
from orchestrator.models import support_table
from orchestrator.plan.figures import LinkRates
from orchestrator.plan.timing import predict

# `\b` keeps click from re-flowing the table's lines into one paragraph.
PLAN_HELP = (
    "Plan each rank's memory per lifecycle phase: params, grads, mains, Adam, backups, engine; "
    "and what a checkpoint save writes, per rank and in all; and each phase's seconds, from the bytes "
    "each rank moves over each link (--measure times this GPU's).\n\n"
    "MODEL is an HF config.json (dense, MoE, MLA and DSA decoders; the text model of a multimodal "
    "config, whose other parts the plan names as not counted) or a preset. "
    "Weight sync to an engine converts these families, checked at these layouts:\n\n\b\n" + support_table()
)
D = o.DEFAULTS


def plan_command(
    model: o.Model,
    tp: o.Tp = D.tp,
    pp: o.Pp = D.pp,
    dp: o.Dp = D.dp,
    ep: o.Ep = D.ep,
    etp: o.Etp = D.etp,
    pp_layers: o.PpLayers = D.pp_layers,
    spec: o.Spec = D.spec,
    mode: o.ModeOption = D.mode,
    distributed_optimizer: o.DistributedOptimizer = D.distributed_optimizer,
    grad_dtype: o.GradDtypeOption = D.grad_dtype,
    adam: o.Adam = D.adam,
    engine_gpus: o.EngineGpus = D.engine_gpus,
    gpu_memory_gb: o.GpuMemoryGb = D.gpu_memory_gb,
    mem_fraction_static: o.MemFractionStatic = D.mem_fraction_static,
    cuda_graph_gb: o.CudaGraphGb = D.cuda_graph_gb,
    kv_tokens: o.KvTokens = D.kv_tokens,
    offload: o.OffloadOption = D.offload,
    pcie_gbps: o.PcieGbps = D.pcie_gbps,
    gpus_per_node: o.GpusPerNode = D.gpus_per_node,
    device_copy_gbps: o.DeviceCopyGbps = D.device_copy_gbps,
    nvlink_gbps: o.NvlinkGbps = D.nvlink_gbps,
    ib_gbps: o.IbGbps = D.ib_gbps,
    train_seconds: o.TrainSeconds = D.train_seconds,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Time this GPU's pinned copies and device copy (1 GiB each) and predict at those rates; "
            "without a CUDA GPU it exits 2.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """`colocate plan`; its help is PLAN_HELP."""
    options = o.PlanOptions(**{k: v for k, v in locals().items() if k not in ("as_json", "measure")})
    try:
        the_plan = options.plan()
        rates = _measured(options.rates()) if measure else options.rates()
    except ConfigError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    stages = predict(the_plan, rates, train_seconds=train_seconds)
    if as_json:
        out = to_json(the_plan, gbps=rates.to_host_gbps) | {"timing": timing_json(the_plan, stages, rates)}
        typer.echo(json.dumps(out, indent=1))
    else:
        show(the_plan, Console(), gbps=rates.to_host_gbps)
        show_timing(the_plan, stages, rates, Console())


def _measured(given: LinkRates) -> LinkRates:
    """The probe, imported here only: it needs torch, which `colocate plan` otherwise never loads."""
    from orchestrator.adapters.link_probe import measure

    return measure(given)
