"""`colocate run`: the job with a progress bar, a summary table, a report and traces."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog
from opentelemetry import trace
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.errors import ConfigError, LifecycleError
from orchestrator.job.checkpoint import ResumePoint
from orchestrator.job.config import RunConfig
from orchestrator.job.interrupt import CTRL_C
from orchestrator.job.job import ColocatedJob
from orchestrator.job.report import RunReport
from orchestrator.telemetry.delivery import Delivery
from orchestrator.telemetry.listeners import Listener
from orchestrator.telemetry.logs import LoggingListener, configure_logging
from orchestrator.telemetry.sparkline import sparkline
from orchestrator.telemetry.tracing import TracingListener, configure_tracing
from states import CYCLE, Event


def summary(report: RunReport, seconds: float) -> Table:
    rewards = [s.reward_mean for s in report.steps if s.loss is not None]  # steps that finished
    table = Table(
        title=f"colocate run: {report.mode}, {report.ranks} rank(s){_beyond_dp(report)}, {len(rewards)} steps done, "
        f"{seconds:.0f} s"
    )
    table.add_column("what")
    table.add_column("value", overflow="fold")
    if rewards:
        first, last = rewards[: min(5, len(rewards))], rewards[-min(5, len(rewards)) :]
        table.add_row("reward curve", f"{sparkline(rewards)}  {rewards[0]:.2f} → {rewards[-1]:.2f}")
        table.add_row("mean reward, first / last 5", f"{sum(first) / len(first):.3f} / {sum(last) / len(last):.3f}")
    for row in _phase_rows(report):
        table.add_row(*row)
    for row in _checkpoint_rows(report):
        table.add_row(*row)
    table.add_row("pinned host bytes per rank", _pinned(report))
    if report.model:
        table.add_row("model", report.model)
    if report.learning:
        table.add_row("learning", report.learning)
    table.add_row("params per rank", f"{report.params_per_rank:,}")
    table.add_row("bf16 param bytes per rank", f"{report.param_bytes_bf16_per_rank:,}")
    freed = [s.bytes_freed_at_drop for s in report.steps if s.bytes_freed_at_drop]
    if freed:
        table.add_row("freed at drop, all ranks", f"{freed[-1]:,} bytes")
    for row in _gpu_rows(report):
        table.add_row(*row)
    verified = [s.restore_verified for s in report.steps if s.restore_verified is not None]
    table.add_row("restores verified bit-identical", f"{sum(verified)} of {len(verified)} checked")
    matches = report.engine_matches_trainer
    table.add_row(
        "engine matches trainer",
        "not checked: the engine cannot report its weights" if matches is None else str(matches),
    )
    if report.trace_file:
        table.add_row("trace file", report.trace_file)
    return table


def _beyond_dp(report: RunReport) -> str:
    """The layout, for the title, where it is more than data parallelism over every rank."""
    return f" ({report.layout})" if report.layout and report.layout != f"DP {report.ranks}" else ""


def _phase_rows(report: RunReport) -> list[tuple[str, str]]:
    """Each event's mean seconds and, where it copies, its bytes and GB/s; over the steady steps
    (3 on: the first two lay out the host arenas and re-home the Adam moments) when there are any."""
    done = [s for s in report.steps if s.loss is not None]
    steady = [s for s in done if s.step >= 3] or done
    rows = []
    for event in (*(row.event for row in CYCLE), Event.SAVE):
        steps = [s for s in steady if event in s.phase_seconds]
        if not steps:
            continue
        seconds = sum(s.phase_seconds[event] for s in steps) / len(steps)
        moved = sum(s.phase_bytes.get(event, 0) for s in steps) / len(steps)
        rate = f", {moved:,.0f} bytes at {moved / seconds / 1e9:.1f} GB/s" if moved and seconds else ""
        rows.append((f"{event} s (mean{', steps 3+' if steady is not done else ''})", f"{seconds:.4f}{rate}"))
    return rows


def _checkpoint_rows(report: RunReport) -> list[tuple[str, str]]:
    """Where the run resumed, how long that took, and the final weights' SHA256."""
    rows = [("resumed from", resumed) for resumed in report.resumed]
    if report.resume_seconds is not None:
        rows.append(("resume s (every rank's load)", f"{report.resume_seconds:.2f}"))
    if report.weights_sha256 is not None:
        rows.append(("final weights SHA256", report.weights_sha256))
    return rows


def _pinned(report: RunReport) -> str:
    """The most pinned per rank, and what the last full step held after each event that moves it."""
    done = [s for s in report.steps if s.loss is not None and s.host_pinned_bytes]
    if not done:
        return f"{report.host_pinned_bytes_per_rank:,}"
    at = ", ".join(f"{event} {n:,}" for event, n in done[-1].host_pinned_bytes.items())
    return f"{report.host_pinned_bytes_per_rank:,} (last step: after {at})"


def _gpu_rows(report: RunReport) -> list[tuple[str, str]]:
    """GPU runs: each GPU's free memory on entering each phase of the last full step, in GiB."""
    steps = [s for s in report.steps if s.gpu_free_bytes and s.loss is not None]
    if not steps:
        return []
    gib = 1 << 30
    return [
        (f"GPU free at {phase}, GiB", " / ".join(f"{b / gib:.2f}" for b in free))
        for phase, free in steps[-1].gpu_free_bytes.items()
    ]


def merge_traces(parts: Path, into: Path) -> None:
    """Concatenate the per-process OTLP-JSON files: each line is a whole export request."""
    with into.open("w") as out:
        for part in sorted(parts.glob("*.otlp.jsonl")):  # none if the run ended before any span
            out.write(part.read_text())
            part.unlink()
    if parts.is_dir():
        parts.rmdir()


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _note(err: Console, line: str) -> None:
    """A process's note at warning or above (its JSON log line), on stderr."""
    err.print(f"[bold yellow]note:[/] {escape(line)}", soft_wrap=True)


def _close_job(job: ColocatedJob, err: Console) -> None:
    try:
        job.close()
    except Exception as exc:  # the report and the spans still matter more
        err.print(f"[yellow]warning:[/] stopping the job's processes: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Ending:
    """How a run ended: what it failed of (None: it did not), whether Ctrl-C stopped it, and what
    is raised on once the run is wrapped up (anything but an error or Ctrl-C: SystemExit, say)."""

    error: str | None = None
    interrupted: bool = False
    refused: bool = False  # by a configuration problem found only once started (an attached cluster's size)
    raised: BaseException | None = None

    @property
    def code(self) -> int:  # 130: the shell's code for SIGINT; 2: a configuration problem, as up front
        return 130 if self.interrupted else 2 if self.refused else 1 if self.error else 0


@dataclass(frozen=True)
class Traces:
    """Where a run's spans go: one file per process under `parts`, merged into `file` at the end;
    neither without --trace-dir."""

    file: Path | None = None
    parts: Path | None = None

    @classmethod
    def under(cls, trace_dir: Path | None, config: RunConfig) -> Traces:
        if trace_dir is None:
            return cls()
        name = f"colocate-{config.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
        return cls(file=trace_dir / f"{name}.otlp.jsonl", parts=trace_dir / f".{name}")


@contextlib.contextmanager
def _telemetry(
    traces: Traces, log_path: Path | None, delivery: Delivery, warn: Callable[[str], None]
) -> Iterator[list[Listener]]:
    """The run's listeners: spans (to `traces.parts`, one file per process, and any OTEL_*
    exporter, counted in `delivery`) and the JSON log, which every process's notes join; those at
    warning and above go to `warn` too. On the way out, however the run ends, every span is
    flushed, the per-process files are merged into `traces.file` and the log is closed."""
    with contextlib.ExitStack() as stack:
        listeners: list[Listener] = []
        parts = traces.parts
        trace_file = parts / "driver.otlp.jsonl" if parts else None
        provider = configure_tracing(rank=0, trace_file=trace_file, delivery=delivery)
        if provider is not None:
            if traces.file is not None and parts is not None:
                stack.callback(merge_traces, parts, traces.file)  # after the flush: callbacks run last first
            stack.callback(provider.shutdown)  # flushes every span, the fault's too
            trace.set_tracer_provider(provider)  # adapters in this process trace through it
            listeners.append(TracingListener(provider))
        log_file = stack.enter_context(log_path.open("a")) if log_path is not None else None
        stack.callback(structlog.reset_defaults)  # before the log closes: no line goes to a closed file
        sink = configure_logging(log_file, warn=warn)
        if sink is not None:
            listeners.append(LoggingListener(sink=sink))
        yield listeners


def run(
    config: RunConfig,
    *,
    resumed: ResumePoint | None = None,
    report_path: Path | None,
    trace_dir: Path | None,
    log_path: Path | None,
    console: Console,
    err: Console,
) -> int:
    """Run the job; returns the exit code.

    However the run ends, by an error of any kind or Ctrl-C, its report is written as soon as its
    steps end, and then its processes are stopped, its spans flushed and merged into one trace
    file and its log closed, before the exit code is returned or the exception that ended it is
    raised on."""
    traces = Traces.under(trace_dir, config)
    start = time.perf_counter()
    delivery = Delivery(warn=lambda line: err.print(f"[bold yellow]warning:[/] {escape(line)}"))
    with contextlib.ExitStack() as stack:  # the telemetry, the progress bar, the job: ended last first
        report, ending = _start_and_drive(stack, config, resumed, traces, log_path, console, err, delivery)
        # The report before the clean-up, whose Ray processes are the slow part to end.
        report.spans_dropped += delivery.take()
        lost = _settle(report, ending, traces, report_path, config.steps, err)
        unwound = _unwind(stack)
    if (late := delivery.take()) and report_path is not None and lost is None:  # dropped in the last flush
        report.spans_dropped += late
        lost = _write_report(report, report_path)
    if report.steps:
        console.print(summary(report, time.perf_counter() - start))
    if lost is not None:  # after the summary, so it is the last thing said
        err.print(f"[bold red]error:[/] {lost}")
    raised = unwound or ending.raised
    if raised is not None:
        raise raised
    return ending.code or (1 if lost is not None else 0)


def _start_and_drive(
    stack: contextlib.ExitStack,
    config: RunConfig,
    resumed: ResumePoint | None,
    traces: Traces,
    log_path: Path | None,
    console: Console,
    err: Console,
    delivery: Delivery,
) -> tuple[RunReport, Ending]:
    """Open the telemetry, the progress bar and the job on `stack` (which ends them), and drive
    the job: its report, and how the run ended. A failure before the job exists (telemetry that
    cannot start, say) ends the run with an empty report, raised on once the run is wrapped up."""
    try:
        listeners = stack.enter_context(_telemetry(traces, log_path, delivery, warn=lambda line: _note(err, line)))
        progress = stack.enter_context(_progress(console))
        job = ColocatedJob(config, listeners, trace_dir=traces.parts, stop=CTRL_C.requested, resumed=resumed)
    except BaseException as exc:
        return RunReport(mode=config.mode.value, ranks=config.ranks), Ending(raised=exc)
    stack.callback(_close_job, job, err)
    return job.report, _drive(job, progress, err)


def _drive(job: ColocatedJob, progress: Progress, err: Console) -> Ending:
    """Start the job and run its steps (the caller stops it): how that ended. A failure is told
    to `err`; anything but an error or Ctrl-C (SystemExit, say) is returned to be raised on."""
    config = job.config
    task = progress.add_task("starting ranks and engine", total=config.steps, reward="-")
    try:
        job.start()  # a Ctrl-C during it ends it (KeyboardInterrupt), and what it started
        description = f"{config.mode} x{config.ranks} {config.device}, {config.engine.kind} engine"
        progress.update(task, description=description, completed=job.steps_begun)  # a resumed run's steps
        for _ in range(config.steps - job.steps_begun):
            if CTRL_C.requested.is_set():
                raise KeyboardInterrupt
            outcome = job.run_step()
            progress.update(task, advance=1, reward=f"{outcome.reward_mean:.3f}")
        if config.checkpoint.save_dir is not None or config.checkpoint.resume is not None:  # a host pass
            job.report.weights_sha256 = job.trainer.weights_sha256()
    except KeyboardInterrupt:
        return Ending(interrupted=True)
    except Exception as exc:  # a LifecycleError names what failed; anything else, its type
        error = str(exc) if isinstance(exc, LifecycleError) else f"{type(exc).__name__}: {exc}"
        err.print(f"[bold red]error:[/] {error}\n[red]the lifecycle is {job.phase}; the run stopped[/]")
        # CTRL_C: a Ctrl-C came first.
        return Ending(error=error, interrupted=CTRL_C.requested.is_set(), refused=isinstance(exc, ConfigError))
    except BaseException as exc:
        return Ending(error=f"{type(exc).__name__}: {exc}", raised=exc)
    return Ending()


def _settle(
    report: RunReport, ending: Ending, traces: Traces, report_path: Path | None, steps: int, err: Console
) -> str | None:
    """Mark the report with how the run ended, say so where Ctrl-C ended it, and write it: None,
    or why it could not be written."""
    report.trace_file = str(traces.file) if traces.file else None
    report.error, report.interrupted = ending.error, ending.interrupted
    if ending.interrupted:
        done = sum(s.loss is not None for s in report.steps)
        kept = f"; the report keeps them in {report_path}" if report_path is not None else ""
        err.print(f"[bold yellow]interrupted[/] after {done} of {steps} step(s){kept}")
    return _write_report(report, report_path) if report_path is not None else None


def _unwind(stack: contextlib.ExitStack) -> BaseException | None:
    """End what `stack` holds, last first, each one tried: what that raised, if anything, to be
    raised on once the run has said how it ended."""
    try:
        stack.close()
    except BaseException as exc:
        return exc
    return None


def _write_report(report: RunReport, path: Path) -> str | None:
    """Write the report; None, or why it could not be (checked up front, a disk can still fill)."""
    try:
        report.write(path)
    except OSError as exc:
        return f"--report {path}: the report could not be written: {exc.strerror or exc}"
    return None
