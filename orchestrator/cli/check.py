"""`colocate check`: one table of checks of the set-up a run is to have, before it starts."""

from __future__ import annotations

import json
import warnings
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli.plan import options as o
from orchestrator.errors import ConfigError
from orchestrator.job.check import Outcome, Row, SetUp, check
from states import TrainingSetup

CHECK_HELP = (
    "Check the set-up a colocated run is to have, before it starts: the plan's memory against this "
    "machine, the SGLang servers (--engine), the conversion, the mode's refusals and the runtime. "
    "Nothing is changed on any server or on the machine. Exit 0: nothing failed; 1: a check failed; "
    "2: bad input."
)
D = o.DEFAULTS
# The trainer's set-up the mode's guards read (`states.TrainingSetup`), each flag named as
# Megatron-LM names the config field `colocate_megatron` reads it from, or as the trainer's own
# flag; the distributed optimizer is the plan's --distributed-optimizer.
Colocate = Annotated[bool, typer.Option(help="The engine shares the trainer's GPUs.")]
OffloadTrain = Annotated[bool, typer.Option(help="The trainer releases its memory for the rollout.")]
ComputeAdvantages = Annotated[bool, typer.Option(help="The per-step block that restores the params runs.")]
Optimizer = Annotated[bool, typer.Option(help="The run has an optimizer (--no-optimizer: none).")]
Lora = Annotated[bool, typer.Option("--lora", help="LoRA adapters train; the base weights are frozen.")]
KeepOldActor = Annotated[bool, typer.Option("--keep-old-actor", help="An old-actor copy of the weights is kept.")]
OverlapParamGather = Annotated[
    bool, typer.Option("--overlap-param-gather", help="Megatron's DDP overlaps the param all-gather.")
]
PrecisionAware = Annotated[
    bool,
    typer.Option(
        "--precision-aware-optimizer",
        help="The optimizer casts in its own step (Megatron-LM's use_precision_aware_optimizer).",
    ),
]
OptimizerCpuOffload = Annotated[
    bool, typer.Option("--optimizer-cpu-offload", help="The optimizer state lives on the host.")
]
DebugTrainOnly = Annotated[bool, typer.Option("--debug-train-only", help="A debug run that never rolls out.")]
SETUP_OPTIONS = (
    "colocate",
    "offload_train",
    "compute_advantages",
    "optimizer",
    "lora",
    "keep_old_actor",
    "overlap_param_gather",
    "precision_aware_optimizer",
    "optimizer_cpu_offload",
    "debug_train_only",
)
STYLE = {Outcome.OK: "green", Outcome.WARN: "yellow", Outcome.FAIL: "bold red", Outcome.SKIPPED: "dim"}


def show(rows: list[Row], console: Console) -> None:
    table = Table(title="colocate check", show_lines=False)
    for column in ("group", "check", "verdict", "read", "fix"):
        table.add_column(column, overflow="fold")
    for row in rows:
        verdict = f"[{STYLE[row.outcome]}]{row.outcome.value}[/]"
        table.add_row(row.group, row.check, verdict, row.read, row.fix or "")
    console.print(table)
    counts = {o: sum(r.outcome is o for r in rows) for o in Outcome}
    console.print(", ".join(f"{n} {o.value}" for o, n in counts.items() if n))


def check_command(
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
    engine: Annotated[
        list[str] | None, typer.Option("--engine", help="An SGLang server the run will drive (repeat for each).")
    ] = None,
    ray_address: Annotated[str | None, typer.Option(help="The Ray cluster the run will attach to.")] = None,
    saves: Annotated[
        bool, typer.Option("--saves", help="The run saves checkpoints (--save-every): count what a save stages.")
    ] = False,
    colocate: Colocate = True,
    offload_train: OffloadTrain = True,
    compute_advantages: ComputeAdvantages = True,
    optimizer: Optimizer = True,
    lora: Lora = False,
    keep_old_actor: KeepOldActor = False,
    overlap_param_gather: OverlapParamGather = False,
    precision_aware_optimizer: PrecisionAware = False,
    optimizer_cpu_offload: OptimizerCpuOffload = False,
    debug_train_only: DebugTrainOnly = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as one JSON object.")] = False,
) -> None:
    """`colocate check`; its help is CHECK_HELP."""
    flags = {k: v for k, v in locals().items() if k in SETUP_OPTIONS}
    given = {
        k: v for k, v in locals().items() if k not in ("engine", "ray_address", "saves", "as_json", "flags", *flags)
    }
    training = TrainingSetup(optimizer_disabled=not flags.pop("optimizer"), **flags)
    try:
        setup = SetUp(
            plan=o.PlanOptions(**given).plan(),
            model=model,
            training=training,
            engines=tuple(engine or ()),
            ray_address=ray_address,
            saves=saves,
        )
    except ConfigError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    # Megatron's import-time notes (no Transformer Engine, no Apex) say nothing of the set-up:
    # kept off the table's stream, in this command's process only.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    with Console(stderr=True).status("checking the set-up") as status:  # the conversion builds the model
        rows = check(setup, on_group=lambda name: status.update(f"checking the set-up: {name}"))
    failed = any(r.outcome is Outcome.FAIL for r in rows)
    if as_json:
        typer.echo(json.dumps({"ok": not failed, "rows": [r.as_json() for r in rows]}, indent=1))
    else:
        show(rows, Console())
    raise typer.Exit(1 if failed else 0)
