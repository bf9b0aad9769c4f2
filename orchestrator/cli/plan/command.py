"""`colocate plan`: the bytes of every rank and phase, before anything is launched."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.cli.plan import options as o
from orchestrator.cli.plan.show import show, to_json
from orchestrator.errors import ConfigError
from orchestrator.models import support_table

# `\b` keeps click from re-flowing the table's lines into one paragraph.
PLAN_HELP = (
    "Plan each rank's memory per lifecycle phase: params, grads, mains, Adam, backups, engine; "
    "and what a checkpoint save writes, per rank and in all.\n\n"
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
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """`colocate plan`; its help is PLAN_HELP."""
    options = o.PlanOptions(**{k: v for k, v in locals().items() if k != "as_json"})
    try:
        the_plan = options.plan()
    except ConfigError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(to_json(the_plan, gbps=pcie_gbps), indent=1))
    else:
        show(the_plan, Console(), gbps=pcie_gbps)
