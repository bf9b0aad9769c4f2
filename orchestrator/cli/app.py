"""The `colocate` command line."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from orchestrator.cli.check import CHECK_HELP, check_command
from orchestrator.cli.plan.command import PLAN_HELP, plan_command
from orchestrator.core import diagram
from orchestrator.core.config import Device, DigestMethod, EngineKind, EnginePause, WeightSync
from orchestrator.errors import ConfigError, TraceError
from states import Mode, Offload


class RunMode(StrEnum):
    REMATERIALIZE = Mode.REMATERIALIZE.value
    BACKUP = Mode.BACKUP.value


app = typer.Typer(
    name="colocate",
    help="Lifecycle controller for colocated RL post-training (Megatron-core trainer + rollout engine).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)  # never break a path or command across lines


@app.callback()
def _root() -> None:
    """Lifecycle controller for colocated RL post-training."""


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.command("diagram")
def diagram_command(
    fmt: Annotated[diagram.Format, typer.Option("--format", "-f", help="Diagram language.")] = diagram.Format.MERMAID,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
    check: Annotated[
        Path | None, typer.Option("--check", help="Exit 1 if this document's generated diagram is stale.")
    ] = None,
    update: Annotated[Path | None, typer.Option("--update", help="Rewrite this document's generated diagram.")] = None,
) -> None:
    """Render the lifecycle's state diagram from the transition table."""
    for document in (check, update):
        if document is not None and not document.is_file():
            _fail(f"{document}: no such file")
    try:
        if check is not None:
            if not diagram.check_document(check.read_text()):
                _fail(f"{check} is stale: run `colocate diagram --update {check}`")
            err.print(f"{check}: diagram is current")
            return
        if update is not None:
            update.write_text(diagram.update_document(update.read_text()))
            err.print(f"{update}: diagram updated")
            return
        text = diagram.render(fmt)
        if output is None:
            typer.echo(text, nl=False)
        else:
            output.write_text(text)
    except ValueError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {exc.filename or output}: {exc.strerror}")


@app.command("run")
def run_command(
    steps: Annotated[int, typer.Option(help="Training steps, each one full cycle.")] = 30,
    ranks: Annotated[
        int | None,
        typer.Option(
            help="Trainer ranks; more than 1 runs them as Ray actors.", show_default="2; 1 with --device cuda"
        ),
    ] = None,
    tp: Annotated[
        int, typer.Option(help="Tensor parallel size: each TP group of consecutive ranks splits every layer.")
    ] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline parallel size: not supported by colocate run yet (1).")] = 1,
    ep: Annotated[int, typer.Option(help="Expert parallel size (MoE models): the experts split over EP ranks.")] = 1,
    mode: Annotated[RunMode, typer.Option(help="How params survive the rollout.")] = RunMode.REMATERIALIZE,
    offload: Annotated[
        Offload, typer.Option(help="Which of grad_buffer, default leave the GPU for the rollout: auto decides.")
    ] = Offload.AUTO,
    verify_cycles: Annotated[int, typer.Option(help="Check the first N restores bit-identical.")] = 2,
    digest: Annotated[
        DigestMethod | None,
        typer.Option(
            help="How those checks digest the params: device (sums on the GPU) or sha256 (on the host).",
            show_default="device with --device cuda, else sha256",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for the task and the sampling.")] = 0,
    device: Annotated[Device, typer.Option(help="Where the ranks train: cuda takes this machine's GPU.")] = Device.CPU,
    engine: Annotated[
        EngineKind, typer.Option(help="transformers: started by the job; sglang: running servers.")
    ] = EngineKind.TRANSFORMERS,
    engine_url: Annotated[
        list[str] | None,
        typer.Option(metavar="URL", help="An SGLang server (repeat for several), e.g. http://127.0.0.1:30000."),
    ] = None,
    weight_sync: Annotated[
        WeightSync,
        typer.Option(help="SGLang: tensor (CUDA IPC, servers on the trainer's GPUs) or broadcast (servers off them)."),
    ] = WeightSync.TENSOR,
    engine_pause: Annotated[
        EnginePause | None,
        typer.Option(
            help="SGLang: how generation is held around each weight update (retract: requeue; abort; in_place; none).",
            show_default="retract",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            envvar="RAY_ADDRESS",
            metavar="HOST:PORT",
            help="Run the ranks on this running Ray cluster (its GCS address); unset: a private one on loopback.",
        ),
    ] = None,
    report: Annotated[Path | None, typer.Option(help="Write the run report here, as JSON.")] = None,
    trace_dir: Annotated[Path | None, typer.Option(help="Write OTLP-JSON traces under this folder.")] = None,
    log: Annotated[
        Path | None, typer.Option(help="Write one JSON log line per transition here, and every process's notes.")
    ] = None,
    rank_timeout: Annotated[
        float, typer.Option(help="Seconds any rank or the engine may take to answer a call (start-up: 300 at least).")
    ] = 120.0,
    model: Annotated[
        str,
        typer.Option(
            metavar="NAME|PATH",
            help="A preset (tiny: CPU-size; qwen-0.5b, llama-1b: GPU-size), a seed workload (qwen3-4b, "
            "deepseek-v3, glm-5: published configs) or an HF config.json; random init, nothing downloaded.",
        ),
    ] = "tiny",
    layers: Annotated[
        int | None, typer.Option(help="Shrink a family model to N layers (published widths and features kept).")
    ] = None,
    experts: Annotated[
        int | None, typer.Option(help="Shrink a family MoE model to E routed experts (its routing groups kept).")
    ] = None,
    prompts: Annotated[
        int | None, typer.Option(help="Prompts per step, each sampled --group-size times.", show_default="128")
    ] = None,
    group_size: Annotated[
        int | None,
        typer.Option(help="Samples per prompt: GRPO's advantages are relative within a group.", show_default="16"),
    ] = None,
    lr: Annotated[
        float | None,
        typer.Option(help="Adam's learning rate (default: the model's own; the summary names the rate used)."),
    ] = None,
    micro_batch: Annotated[
        int,
        typer.Option(help="Rows per forward and backward of train; a step's grads add up over them (0: all at once)."),
    ] = 0,
    save_every: Annotated[int, typer.Option(help="Save a checkpoint every N steps (0: never); needs --save-dir.")] = 0,
    save_dir: Annotated[Path | None, typer.Option(help="Where checkpoints go: DIR/step-NNNNNN, each complete.")] = None,
    resume: Annotated[
        Path | None, typer.Option(metavar="DIR", help="Continue from the last complete checkpoint in DIR.")
    ] = None,
) -> None:
    """Run the colocated GRPO job: Megatron-core ranks and a rollout engine, one full cycle per step."""
    from orchestrator.core.config import Checkpoint, Verify
    from orchestrator.job.checkpoint import resume_point
    from orchestrator.job.config import Cluster, Engine, RunConfig
    from orchestrator.job.grpo import GRPOConfig
    from orchestrator.job.outputs import output_problems
    from orchestrator.job.preflight import preflight
    from orchestrator.job.presets import grpo_config
    from orchestrator.job.run import run
    from orchestrator.telemetry.tracing import exporter_problems

    problems: list[str] = (
        output_problems(report=report, log=log, trace_dir=trace_dir, save_dir=save_dir) + exporter_problems()
    )
    try:
        grpo = grpo_config(model, layers=layers, experts=experts)
    except ConfigError as exc:
        problems += [str(v) if str(v).startswith("--") else f"--model: {v}" for v in exc.violations]
        grpo = GRPOConfig()
    except ValueError as exc:
        problems.append(f"--model: {exc}")
        grpo = GRPOConfig()
    if prompts is not None and prompts < 1:
        problems.append(f"--prompts must be at least 1, got {prompts}")
    if group_size is not None and group_size < 2:
        problems.append(f"--group-size must be at least 2 (advantages are relative within a group), got {group_size}")
    if lr is not None and not lr > 0:
        problems.append(f"--lr must be above 0, got {lr}")
    if micro_batch < 0:
        problems.append(f"--micro-batch must be at least 0 (0: every row at once), got {micro_batch}")
    with contextlib.suppress(ConfigError):  # a size refused is named above
        grpo = dataclasses.replace(
            grpo,
            prompts_per_step=grpo.prompts_per_step if prompts is None else prompts,
            group_size=grpo.group_size if group_size is None else group_size,
            micro_batch=micro_batch,
            model=grpo.model if lr is None else dataclasses.replace(grpo.model, lr=lr),
        )
    try:
        config = RunConfig(
            grpo=grpo,
            steps=steps,
            ranks=ranks if ranks is not None else (1 if device is Device.CUDA else 2),
            tp=tp,
            pp=pp,
            ep=ep,
            mode=Mode(mode.value),
            offload=offload,
            seed=seed,
            device=device,
            engine=Engine(kind=engine, urls=tuple(engine_url or ()), weight_sync=weight_sync, pause=engine_pause),
            cluster=Cluster(ray_address=ray_address or None, rank_timeout_s=rank_timeout),
            verify=Verify(cycles=verify_cycles, digest=digest),
            checkpoint=Checkpoint(save_every=save_every, save_dir=save_dir, resume=resume),
        )
        preflight(config)  # the machine: read once, once the config itself holds
        resumed = resume_point(config) if config.checkpoint.resume is not None and not problems else None
    except ConfigError as exc:
        problems += [str(v) for v in exc.violations]
    if problems:  # every problem at once, before any rank starts
        _fail(str(ConfigError(problems)), code=2)
    code = run(
        config, resumed=resumed, report_path=report, trace_dir=trace_dir, log_path=log, console=Console(), err=err
    )
    raise typer.Exit(code)


@app.command("engine-config")
def engine_config_command(
    folder: Annotated[Path, typer.Argument(help="Where to write config.json (created if missing).")],
    force: Annotated[bool, typer.Option(help="Replace an existing config.json.")] = False,
) -> None:
    """Write the Hugging Face config of the model `colocate run` trains, for an SGLang server to load.

    Start the server with `--load-format dummy`: colocate sends every weight before the first rollout.
    """
    from orchestrator.adapters.megatron.convert import hf_llama_config
    from orchestrator.job.presets import preset

    target = folder / "config.json"
    if target.exists() and not force:
        _fail(f"{target} exists; pass --force to replace it")
    if folder.exists() and not folder.is_dir():
        _fail(f"{folder}: exists and is not a folder")
    try:
        write_model_config(hf_llama_config(preset("tiny")), folder)
    except OSError as exc:
        _fail(f"cannot write {target}: {exc.strerror or exc}")
    err.print(f"{target}: written. Serve it with")
    typer.echo(
        f"python -m sglang.launch_server --model-path {folder} --load-format dummy --skip-tokenizer-init "
        "--enable-memory-saver --port 30000"
    )


def write_model_config(config: Any, folder: Path) -> None:
    """`config.json` as SGLang and transformers pick and build a model class from it.

    SGLang's model registry chooses the class by `architectures`, transformers' `AutoConfig` the
    config class by `model_type`, and SGLang's `--dtype auto` reads `torch_dtype`: transformers 5
    writes `dtype` alone, so the older key is written beside it.
    """
    import json

    data = config.to_dict()
    data["architectures"] = data.get("architectures") or ["LlamaForCausalLM"]
    data["model_type"] = config.model_type
    dtype = str(data.get("dtype") or "bfloat16").removeprefix("torch.")
    data["dtype"] = data["torch_dtype"] = dtype
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


trace_app = typer.Typer(
    help="Read OTLP-JSON trace files back: a table per lifecycle phase, a picture per step.", no_args_is_help=True
)
app.add_typer(trace_app, name="trace")
TraceFiles = Annotated[list[Path], typer.Argument(help="OTLP-JSON files, or folders of *.jsonl files.")]


@trace_app.command("summarize")
def trace_summarize_command(
    files: TraceFiles,
    as_json: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON, for scripts.")] = False,
) -> None:
    """Per lifecycle phase: ms per step, p50 and p95, the slowest trainer rank, bytes moved."""
    import json

    from orchestrator.cli import traces

    try:
        summary = traces.summarize(traces.load(files))
    except TraceError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(summary.to_json(), indent=2))
        return
    console = Console()
    console.print(traces.summary_table(summary))
    console.print(traces.summary_line(summary))
    if len(set(summary.steps)) < len(summary.steps):
        err.print("[yellow]warning:[/] step numbers repeat: these files hold more than one run")


@trace_app.command("timeline")
def trace_timeline_command(
    files: TraceFiles,
    output: Annotated[Path, typer.Option("--output", "-o", help="The picture: a .png or .svg file.")],
    step: Annotated[int | None, typer.Option(help="Which step (default: the last complete one).")] = None,
) -> None:
    """Draw one step: the driver's phases, each trainer rank's work and the engine's, in ms."""
    from orchestrator.cli import traces
    from orchestrator.cli.traces import timeline

    if output.suffix.lower() not in (".png", ".svg"):
        _fail(f"--output {output}: use a .png or .svg file")
    if not output.parent.is_dir():
        _fail(f"--output {output}: folder {output.parent} does not exist")
    try:
        chosen = traces.load(files).step(step)
        timeline.draw_timeline(chosen, output)
    except TraceError as exc:
        _fail(str(exc))
    err.print(f"{output}: step {chosen.number}, {chosen.root.duration_ms:.1f} ms")


app.command("plan", help=PLAN_HELP)(plan_command)
app.command("check", help=CHECK_HELP)(check_command)


def main() -> None:
    from orchestrator.job.interrupt import CTRL_C

    CTRL_C.install()  # once, for the process's life (orchestrator/job/interrupt.py)
    try:
        app()
    except SystemExit as done:  # how typer ends every command
        if "torch" in sys.modules:  # loaded by a run (or a command like it): its teardown is slow
            _leave(done.code)
        raise


def _leave(code: object) -> None:
    """Exit with `code` once the command is done and every output of it closed (a run's report,
    log and traces written, its Ray stopped), without the interpreter's teardown of the modules:
    with torch, Ray and Megatron loaded that takes seconds (1.7 s at a load of 6 on 2 cores), and
    there is nothing left for it to do. What Python's exit does before it is still done: the
    threads that are not daemons are waited for, the exit handlers run, the streams flushed."""
    import atexit
    import os
    import threading

    if code is not None and not isinstance(code, int):  # SystemExit("message"), as Python says it
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if not thread.daemon and thread is not threading.current_thread():
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
