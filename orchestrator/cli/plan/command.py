"""`colocate plan`: the bytes of every rank and phase, before anything is launched."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.cli.plan.show import show, to_json
from orchestrator.errors import ConfigError
from orchestrator.models import ModelShape, support_table
from orchestrator.plan.memory import EngineSpec, GradDtype, OptimizerSpec, Parallelism, plan
from orchestrator.plan.model import LayerSpec
from orchestrator.plan.offload import PINNED_COPY_GBPS
from orchestrator.plan.presets import PRESETS, load_model
from states import Mode, Offload

# `\b` keeps click from re-flowing the table's lines into one paragraph.
PLAN_HELP = (
    "Plan each rank's memory per lifecycle phase: params, grads, mains, Adam, backups, engine; "
    "and what a checkpoint save writes, per rank and in all.\n\n"
    "MODEL is an HF config.json (dense, MoE, MLA and DSA decoders; the text model of a multimodal "
    "config, whose other parts the plan names as not counted) or a preset. "
    "Weight sync to an engine converts these families, checked at these layouts:\n\n\b\n" + support_table()
)


def _split(text: str | None, problems: list[str]) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        problems.append(f"--pp-layers {text!r}: give comma-separated layer counts, e.g. 19,20,20,19")
        return ()


def _option_problems(
    *, mode: str, pcie_gbps: float, engine: EngineSpec, gpu_memory_gb: float, cuda_graph_gb: float, gpus_per_node: int
) -> list[str]:
    """Every option out of its range, named by its flag."""
    checks = {
        f"--mode must be rematerialize or backup, got {mode!r}": mode not in (Mode.REMATERIALIZE, Mode.BACKUP),
        f"--pcie-gbps must be a positive rate, got {pcie_gbps}": not pcie_gbps > 0,
        f"--engine-gpus must be >= 0 (0: TP x PP), got {engine.gpus}": engine.gpus < 0,
        f"--gpu-memory-gb must be > 0, got {gpu_memory_gb}": not gpu_memory_gb > 0,
        f"--cuda-graph-gb must be >= 0, got {cuda_graph_gb}": not cuda_graph_gb >= 0,
        f"--mem-fraction-static must be in (0, 1], got {engine.mem_fraction_static}": not (
            0 < engine.mem_fraction_static <= 1
        ),
        f"--kv-tokens must be >= 0, got {engine.kv_tokens}": engine.kv_tokens < 0,
        f"--gpus-per-node must be >= 1, got {gpus_per_node}": gpus_per_node < 1,
    }
    return [problem for problem, bad in checks.items() if bad]


def _model(model: str, layout: Parallelism, problems: list[str]) -> ModelShape:
    """The model, or one ConfigError naming every problem with it, the layout and the options."""
    try:
        spec = load_model(model)
    except ConfigError as exc:
        raise ConfigError([*problems, *map(str, exc.violations)]) from None
    problems = problems + layout.problems(spec)
    if problems:
        raise ConfigError(problems)
    return spec


def plan_command(
    model: Annotated[
        str, typer.Argument(help=f"An HF config.json (or its folder), or a preset: {', '.join(sorted(PRESETS))}.")
    ],
    tp: Annotated[int, typer.Option(help="Tensor parallel size.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline parallel size.")] = 1,
    dp: Annotated[int, typer.Option(help="Data parallel size.")] = 1,
    ep: Annotated[int, typer.Option(help="Expert parallel size.")] = 1,
    etp: Annotated[
        int | None,
        typer.Option(help="Expert tensor parallel size (default: --tp, as Megatron's initialize_model_parallel)."),
    ] = None,
    pp_layers: Annotated[str | None, typer.Option(help="Decoder layers per stage, e.g. 19,20,20,19.")] = None,
    spec: Annotated[
        LayerSpec,
        typer.Option(help="Megatron's layer spec: te replicates MLA's down projections over TP, local splits them."),
    ] = LayerSpec.TE,
    mode: Annotated[str, typer.Option(help="rematerialize or backup.")] = Mode.REMATERIALIZE.value,
    distributed_optimizer: Annotated[bool, typer.Option(help="Megatron's DistributedOptimizer.")] = True,
    grad_dtype: Annotated[GradDtype, typer.Option(help="Grad buffer dtype.")] = GradDtype.FP32,
    adam: Annotated[bool, typer.Option(help="Adam's two fp32 moments (--no-adam: none).")] = True,
    engine_gpus: Annotated[int, typer.Option(help="GPUs one engine replica spans (0: TP x PP).")] = 0,
    gpu_memory_gb: Annotated[float, typer.Option(help="Memory of one GPU, GB (an H200: 150.75).")] = 150.75,
    mem_fraction_static: Annotated[float, typer.Option(help="The engine's share for weights + KV.")] = 0.8,
    cuda_graph_gb: Annotated[float, typer.Option(help="The engine's CUDA graphs, GB (measure it).")] = 0.0,
    kv_tokens: Annotated[
        int, typer.Option(help="Tokens the KV cache holds (max batch x max len); 0: sized by --mem-fraction-static.")
    ] = 0,
    offload: Annotated[
        Offload, typer.Option(help="Which of grad_buffer, default leave the GPU for the rollout: auto decides.")
    ] = Offload.AUTO,
    pcie_gbps: Annotated[
        float, typer.Option(help="Pinned host<->device copy rate each way, GB/s, to price a move.")
    ] = PINNED_COPY_GBPS,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node, for the node totals.")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """`colocate plan`; its help is PLAN_HELP."""
    err = Console(stderr=True, soft_wrap=True)
    engine = EngineSpec(
        gpus=engine_gpus,
        device_bytes=int(gpu_memory_gb * 1e9),
        mem_fraction_static=mem_fraction_static,
        cuda_graph_bytes=int(cuda_graph_gb * 1e9),
        kv_tokens=kv_tokens,
    )
    try:
        problems = _option_problems(
            mode=mode,
            pcie_gbps=pcie_gbps,
            engine=engine,
            gpu_memory_gb=gpu_memory_gb,
            cuda_graph_gb=cuda_graph_gb,
            gpus_per_node=gpus_per_node,
        )
        etp_given = {} if etp is None else {"etp": etp}  # not given: TP, as Megatron's
        layout = Parallelism(tp=tp, pp=pp, dp=dp, ep=ep, **etp_given, pp_layers=_split(pp_layers, problems), spec=spec)
        the_plan = plan(
            _model(model, layout, problems),
            layout,
            optimizer=OptimizerSpec(distributed=distributed_optimizer, grad_dtype=grad_dtype, adam=adam),
            engine=engine,
            mode=Mode(mode),
            gpus_per_node=gpus_per_node,
            offload=offload,
        )
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(to_json(the_plan, gbps=pcie_gbps), indent=1))
    else:
        show(the_plan, Console(), gbps=pcie_gbps)
