"""The options of every command that takes a model and a layout (`colocate plan`, `colocate
check`), each defined once, and the plan they describe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer

from orchestrator.errors import ConfigError
from orchestrator.models import ModelShape
from orchestrator.plan.figures import DEVICE_COPY_GBPS, IB_GBPS, NVLINK_GBPS, PUBLISHED_RATES, LinkRates
from orchestrator.plan.memory import EngineSpec, GradDtype, OptimizerSpec, Parallelism, Plan, plan
from orchestrator.plan.model import LayerSpec
from orchestrator.plan.offload import PINNED_COPY_GBPS
from orchestrator.plan.presets import PRESETS, load_model
from states import Mode, Offload


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


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """What `colocate plan` (and `colocate check`, which takes the same layout) is given."""

    model: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None
    pp_layers: str | None = None
    spec: LayerSpec = LayerSpec.TE
    mode: str = Mode.REMATERIALIZE.value
    distributed_optimizer: bool = True
    grad_dtype: GradDtype = GradDtype.FP32
    adam: bool = True
    engine_gpus: int = 0
    gpu_memory_gb: float = 150.75
    mem_fraction_static: float = 0.8
    cuda_graph_gb: float = 0.0
    kv_tokens: int = 0
    offload: Offload = Offload.AUTO
    pcie_gbps: float = PINNED_COPY_GBPS
    gpus_per_node: int = 8
    # The time model's other links (the pinned one is `pcie_gbps`) and the train's seconds.
    device_copy_gbps: float = DEVICE_COPY_GBPS
    nvlink_gbps: float = NVLINK_GBPS
    ib_gbps: float = IB_GBPS
    train_seconds: float | None = None

    def rates(self) -> LinkRates:
        """The links' rates these options give: the published figures where none is given."""
        published = (PINNED_COPY_GBPS, DEVICE_COPY_GBPS, NVLINK_GBPS, IB_GBPS)
        given = (self.pcie_gbps, self.device_copy_gbps, self.nvlink_gbps, self.ib_gbps)
        return LinkRates(
            to_host_gbps=self.pcie_gbps,
            from_host_gbps=self.pcie_gbps,
            device_copy_gbps=self.device_copy_gbps,
            nvlink_gbps=self.nvlink_gbps,
            ib_gbps=self.ib_gbps,
            source=PUBLISHED_RATES if given == published else "published H200 figures, with the rates given",
        )

    def plan(self) -> Plan:
        """The plan these options describe, or one ConfigError naming every problem with them."""
        engine = EngineSpec(
            gpus=self.engine_gpus,
            device_bytes=int(self.gpu_memory_gb * 1e9),
            mem_fraction_static=self.mem_fraction_static,
            cuda_graph_bytes=int(self.cuda_graph_gb * 1e9),
            kv_tokens=self.kv_tokens,
        )
        problems = _option_problems(
            mode=self.mode,
            pcie_gbps=self.pcie_gbps,
            engine=engine,
            gpu_memory_gb=self.gpu_memory_gb,
            cuda_graph_gb=self.cuda_graph_gb,
            gpus_per_node=self.gpus_per_node,
        )
        problems += [
            f"{flag} must be a positive rate, got {rate}"
            for flag, rate in (
                ("--device-copy-gbps", self.device_copy_gbps),
                ("--nvlink-gbps", self.nvlink_gbps),
                ("--ib-gbps", self.ib_gbps),
            )
            if not rate > 0
        ]
        if self.train_seconds is not None and not self.train_seconds >= 0:
            problems.append(f"--train-seconds must be >= 0, got {self.train_seconds}")
        etp_given = {} if self.etp is None else {"etp": self.etp}  # not given: TP, as Megatron's
        layout = Parallelism(
            tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, **etp_given,
            pp_layers=_split(self.pp_layers, problems), spec=self.spec,
        )  # fmt: skip
        return plan(
            _model(self.model, layout, problems),
            layout,
            optimizer=OptimizerSpec(distributed=self.distributed_optimizer, grad_dtype=self.grad_dtype, adam=self.adam),
            engine=engine,
            mode=Mode(self.mode),
            gpus_per_node=self.gpus_per_node,
            offload=self.offload,
        )


# The options, one definition each, for every command that takes a layout.
Model = Annotated[
    str, typer.Argument(help=f"An HF config.json (or its folder), or a preset: {', '.join(sorted(PRESETS))}.")
]
Tp = Annotated[int, typer.Option(help="Tensor parallel size.")]
Pp = Annotated[int, typer.Option(help="Pipeline parallel size.")]
Dp = Annotated[int, typer.Option(help="Data parallel size.")]
Ep = Annotated[int, typer.Option(help="Expert parallel size.")]
Etp = Annotated[
    int | None,
    typer.Option(help="Expert tensor parallel size (default: --tp, as Megatron's initialize_model_parallel)."),
]
PpLayers = Annotated[str | None, typer.Option(help="Decoder layers per stage, e.g. 19,20,20,19.")]
Spec = Annotated[
    LayerSpec,
    typer.Option(help="Megatron's layer spec: te replicates MLA's down projections over TP, local splits them."),
]
ModeOption = Annotated[str, typer.Option("--mode", help="rematerialize or backup.")]
DistributedOptimizer = Annotated[bool, typer.Option(help="Megatron's DistributedOptimizer.")]
GradDtypeOption = Annotated[GradDtype, typer.Option("--grad-dtype", help="Grad buffer dtype.")]
Adam = Annotated[bool, typer.Option(help="Adam's two fp32 moments (--no-adam: none).")]
EngineGpus = Annotated[int, typer.Option(help="GPUs one engine replica spans (0: TP x PP).")]
GpuMemoryGb = Annotated[float, typer.Option(help="Memory of one GPU, GB (an H200: 150.75).")]
MemFractionStatic = Annotated[float, typer.Option(help="The engine's share for weights + KV.")]
CudaGraphGb = Annotated[float, typer.Option(help="The engine's CUDA graphs, GB (measure it).")]
KvTokens = Annotated[
    int, typer.Option(help="Tokens the KV cache holds (max batch x max len); 0: sized by --mem-fraction-static.")
]
OffloadOption = Annotated[
    Offload,
    typer.Option("--offload", help="Which of grad_buffer, default leave the GPU for the rollout: auto decides."),
]
PcieGbps = Annotated[float, typer.Option(help="Pinned host<->device copy rate each way, GB/s, to price a move.")]
GpusPerNode = Annotated[int, typer.Option(help="GPUs per node, for the node totals and which links a group crosses.")]
DeviceCopyGbps = Annotated[
    float, typer.Option(help="Device-to-device copy rate, GB/s of bytes copied (an H200: 2,100 measured).")
]
NvlinkGbps = Annotated[float, typer.Option(help="NVLink rate per GPU, one direction, GB/s (NVLink 4: 450).")]
IbGbps = Annotated[float, typer.Option(help="InfiniBand rate per GPU's NIC, one direction, GB/s (NDR: 50).")]
TrainSeconds = Annotated[
    float | None,
    typer.Option(
        help="One step's forward + backward, s: how much of the moments' stream it hides (unknown if not given)."
    ),
]

DEFAULTS = PlanOptions(model="")  # the defaults, once
