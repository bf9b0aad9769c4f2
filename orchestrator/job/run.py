"""`colocate run`: the job with a progress bar, a summary table, a report and traces."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.errors import ConfigError, LifecycleError
from orchestrator.job.checkpoint import ResumePoint
from orchestrator.job.config import RunConfig
from orchestrator.job.interrupt import CTRL_C
from orchestrator.job.job import ColocatedJob
from orchestrator.job.report import RunReport
from orchestrator.telemetry.listeners import Listener
from orchestrator.telemetry.logs import LoggingListener, configure_logging
from orchestrator.telemetry.sparkline import sparkline
from orchestrator.telemetry.tracing import TracingListener, configure_tracing
from states import CYCLE, Event


def summary(report: RunReport, seconds: float) -> Table:
    rewards = [s.reward_mean for s in report.steps if s.loss is not None]  # steps that finished
    table = Table(
        title=f"colocate run: {report.mode}, {report.ranks} rank(s), {len(rewards)} steps done, {seconds:.0f} s"
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


def _close(job: ColocatedJob, err: Console) -> None:
    try:
        job.close()
    except Exception as exc:  # the report and the spans still matter more
        err.print(f"[yellow]warning:[/] stopping the job's processes: {type(exc).__name__}: {exc}")


@dataclass
class Ending:
    """How a run ended: what it failed of (None: it did not), and whether Ctrl-C stopped it."""

    error: str | None = None
    interrupted: bool = False
    refused: bool = False  # by a configuration problem found only once started (an attached cluster's size)

    @property
    def code(self) -> int:  # 130: the shell's code for SIGINT; 2: a configuration problem, as up front
        return 130 if self.interrupted else 2 if self.refused else 1 if self.error else 0


@contextlib.contextmanager
def _telemetry(parts: Path | None, trace_file: Path | None, log_path: Path | None) -> Iterator[list[Listener]]:
    """The run's listeners: spans (to `parts`, one file per process, and any OTEL_* exporter) and
    the JSON log. On the way out, however the run ends, every span is flushed, the per-process
    files are merged into `trace_file` and the log is closed."""
    with contextlib.ExitStack() as stack:
        listeners: list[Listener] = []
        provider = configure_tracing(rank=0, trace_file=parts / "driver.otlp.jsonl" if parts else None)
        if provider is not None:
            if trace_file is not None and parts is not None:
                stack.callback(merge_traces, parts, trace_file)  # after the flush: callbacks run last first
            stack.callback(provider.shutdown)  # flushes every span, the fault's too
            trace.set_tracer_provider(provider)  # adapters in this process trace through it
            listeners.append(TracingListener(provider))
        if log_path is not None:
            log_file = stack.enter_context(log_path.open("a"))
            listeners.append(LoggingListener(sink=configure_logging(log_file)))
        yield listeners


def _drive(job: ColocatedJob, ending: Ending, progress: Progress, err: Console) -> None:
    """Start the job and run its steps (the caller stops it). A failure is recorded in `ending`
    and told to `err`; anything but an error or Ctrl-C (SystemExit, say) is raised on."""
    config = job.config
    task = progress.add_task("starting ranks and engine", total=config.steps, reward="-")
    try:
        job.start()  # a Ctrl-C during it ends it (KeyboardInterrupt), and what it started
        description = f"{config.mode} x{config.ranks} {config.device}, {config.engine} engine"
        progress.update(task, description=description, completed=job.steps_begun)  # a resumed run's steps
        for _ in range(config.steps - job.steps_begun):
            if CTRL_C.requested.is_set():
                raise KeyboardInterrupt
            outcome = job.run_step()
            progress.update(task, advance=1, reward=f"{outcome.reward_mean:.3f}")
        if config.save_dir is not None or config.resume is not None:  # a host pass over every weight
            job.report.weights_sha256 = job.trainer.weights_sha256()
    except KeyboardInterrupt:
        ending.interrupted = True
    except Exception as exc:  # a LifecycleError names what failed; anything else, its type
        ending.interrupted = CTRL_C.requested.is_set()  # a Ctrl-C came first
        ending.refused = isinstance(exc, ConfigError)
        ending.error = str(exc) if isinstance(exc, LifecycleError) else f"{type(exc).__name__}: {exc}"
        err.print(f"[bold red]error:[/] {ending.error}\n[red]the lifecycle is {job.phase}; the run stopped[/]")
    except BaseException as exc:
        ending.error = f"{type(exc).__name__}: {exc}"
        raise


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
    run_name = f"colocate-{config.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    trace_file = trace_dir / f"{run_name}.otlp.jsonl" if trace_dir else None
    parts = trace_dir / f".{run_name}" if trace_dir else None  # one file per process, merged at the end
    start = time.perf_counter()
    ending = Ending()
    report = RunReport(mode=config.mode.value, ranks=config.ranks)
    settled = False
    lost: str | None = None  # why the report could not be written

    def settle() -> None:
        """Mark the report with how the run ended, say so, and write it; once."""
        nonlocal settled, lost
        if settled:
            return
        settled = True
        report.trace_file = str(trace_file) if trace_file else None
        report.error, report.interrupted = ending.error, ending.interrupted
        if ending.interrupted:
            done = sum(s.loss is not None for s in report.steps)
            kept = f"; the report keeps them in {report_path}" if report_path is not None else ""
            err.print(f"[bold yellow]interrupted[/] after {done} of {config.steps} step(s){kept}")
        if report_path is not None:
            lost = _write_report(report, report_path)

    try:
        with _telemetry(parts, trace_file, log_path) as listeners, _progress(console) as progress:
            job = ColocatedJob(config, listeners, trace_dir=parts, stop=CTRL_C.requested, resumed=resumed)
            report = job.report
            try:
                _drive(job, ending, progress, err)
            finally:  # the report before the clean-up, whose Ray processes are the slow part to end
                settle()
                _close(job, err)
    finally:
        settle()  # where the run ended before its job did
        if report.steps:
            console.print(summary(report, time.perf_counter() - start))
        if lost is not None:  # after the summary, so it is the last thing said
            err.print(f"[bold red]error:[/] {lost}")
    return ending.code or (1 if lost is not None else 0)


def _write_report(report: RunReport, path: Path) -> str | None:
    """Write the report; None, or why it could not be (checked up front, a disk can still fill)."""
    try:
        report.write(path)
    except OSError as exc:
        return f"--report {path}: the report could not be written: {exc.strerror or exc}"
    return None
