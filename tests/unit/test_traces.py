"""Trace files read back: a synthetic two-step run written by the real SDK and our file exporter."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue
from typer.testing import CliRunner

from orchestrator.cli import traces
from orchestrator.cli.app import app
from orchestrator.cli.traces import timeline
from orchestrator.errors import TraceError, TraceFileError
from orchestrator.telemetry.tracing import OtlpJsonFileExporter

MS = 1_000_000
T0 = 1_700_000_000_000 * MS
UPDATE_MS = {1: 100, 2: 200}  # update_weights takes 100 ms in step 1, 200 ms in step 2
PUSH_MS = {0: 60, 1: 90}  # per rank, rank.push_weights under update_weights, every step


class Process:
    """One process's tracer provider, writing its own OTLP-JSON file."""

    def __init__(self, folder: Path, name: str, role: str, rank: int | None = None, batch: bool = False) -> None:
        attributes: dict[str, str | int] = {"service.name": name, "colocate.role": role}
        if rank is not None:
            attributes["colocate.rank"] = rank
        self.provider = TracerProvider(resource=Resource.create(attributes))
        exporter = OtlpJsonFileExporter(folder / f"{name}.jsonl")
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("test")

    def start(self, name: str, parent: trace.Span | None, start_ms: float, **attrs: AttributeValue) -> trace.Span:
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracer.start_span(name, context=context, start_time=T0 + int(start_ms * MS), attributes=attrs)

    def span(
        self, name: str, parent: trace.Span | None, start_ms: float, end_ms: float, **attrs: AttributeValue
    ) -> trace.Span:
        span = self.start(name, parent, start_ms, **attrs)
        span.end(end_time=T0 + int(end_ms * MS))
        return span


def write_run(folder: Path) -> Path:
    """Two steps from four processes, four files: the driver (batched), two trainer ranks, the engine;
    and the start-up's and the close's traces, the driver's."""
    folder.mkdir(exist_ok=True)
    driver = Process(folder, "driver", "driver", batch=True)
    ranks = [Process(folder, f"trainer-{r}", "trainer", rank=r) for r in (0, 1)]
    engine = Process(folder, "engine", "engine")
    for number in (1, 2):
        base, update = (number - 1) * 1000, UPDATE_MS[number]
        root = driver.start("colocate.step", None, base, **{"colocate.step": number})
        driver.span("lifecycle.pause_grads", root, base, base + 10, **{"colocate.event": "pause_grads"})
        phase = driver.start("lifecycle.update_weights", root, base + 10, **{"colocate.bytes_moved": 1000})
        for rank, process in enumerate(ranks):
            push = process.span("rank.push_weights", phase, base + 12, base + 12 + PUSH_MS[rank])
            process.span("rank.bucket", push, base + 13, base + 40, **{"colocate.bytes": 500})  # nested: counts once
        engine.span("engine.update_weights", phase, base + 15, base + 10 + update - 5)
        phase.end(end_time=T0 + (base + 10 + update) * MS)
        if number == 2:
            refused = driver.start("lifecycle.skip_update", root, base + 10 + update, **{"colocate.refused": True})
            refused.set_status(Status(StatusCode.ERROR, "refused"))
            refused.end(end_time=T0 + (base + 10 + update) * MS)
        phase = driver.start("lifecycle.train", root, base + 10 + update)
        for rank, process in enumerate(ranks):
            process.span("rank.train", phase, base + 10 + update + 1, base + 390 - 10 * rank)
        phase.end(end_time=T0 + (base + 400) * MS)
        root.end(end_time=T0 + (base + 400) * MS)
    # The start-up's and the close's traces, which are no step's: not "rootless".
    for name, child, at in (
        ("colocate.start", "start.ranks", -100),
        ("colocate.close", "POST /resume_memory_occupation", 2000),
    ):
        root = driver.start(name, None, at)
        driver.span(child, root, at + 1, at + 9)
        root.end(end_time=T0 + (at + 10) * MS)
    for process in (driver, *ranks, engine):
        process.provider.shutdown()
    return folder


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "traces")


def test_load_joins_the_processes_files_into_steps(run_dir: Path) -> None:
    loaded = traces.load([run_dir])
    assert [s.number for s in loaded.steps] == [1, 2] and loaded.rootless == 0
    step = loaded.steps[0]
    names = {s.name for s in step.spans}
    assert {"lifecycle.update_weights", "rank.push_weights", "rank.bucket", "engine.update_weights"} <= names
    push = next(s for s in step.spans if s.name == "rank.push_weights" and s.rank == 1)
    assert push.resource["colocate.role"] == "trainer" and push.duration_ms == pytest.approx(90)
    assert step.phase_of(push) is not None and step.phase_of(push).name == "lifecycle.update_weights"  # type: ignore[union-attr]
    assert len(step.root.trace_id) == 32 and len(push.span_id) == 16


def test_summary_numbers(run_dir: Path) -> None:
    summary = traces.summarize(traces.load([run_dir]))
    phases = {p.event: p for p in summary.phases}
    assert list(phases)[:2] == ["pause_grads", "update_weights"]  # in the order a step runs them
    update = phases["update_weights"]
    assert update.durations_ms == pytest.approx((100, 200))
    assert update.p50_ms == pytest.approx(150) and update.p95_ms == pytest.approx(195)
    assert update.rank_ms == pytest.approx({0: 60, 1: 90})  # the nested rank.bucket is not counted twice
    assert update.slowest_rank == (1, pytest.approx(30))
    assert update.bytes == {"moved": 1000}
    skip = phases["skip_update"]
    assert skip.refused == (0, 1) and skip.durations_ms == (None, None) and skip.p50_ms is None
    assert phases["train"].slowest_rank == (0, pytest.approx(10))
    assert summary.wall_ms == pytest.approx(1400) and summary.step_ms == pytest.approx((400, 400))


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert traces.percentile([], 0.5) is None
    assert traces.percentile([3.0], 0.95) == 3.0
    assert traces.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert traces.percentile(list(map(float, range(101))), 0.95) == pytest.approx(95)


@pytest.mark.parametrize(
    ("content", "where", "problem"),
    [
        ("", "bad.jsonl", "empty file"),
        ('{"resourceSpans": []}\nnot json\n', "bad.jsonl:2", "not JSON"),
        ("[]\n", "bad.jsonl:1", "expected an object with resourceSpans"),
        ('{"resourceSpans": [], "bogus": 1}\n', "bad.jsonl:1", "not an OTLP trace export"),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"abcd","spanId":"0011223344556677","name":"x"}]}]}]}\n',
            "bad.jsonl:1",
            "trace id is 2 bytes, not 16",
        ),
    ],
    ids=["empty", "not-json", "a-list", "unknown-field", "bad-trace-id"],
)
def test_malformed_file_names_the_file_and_line(tmp_path: Path, content: str, where: str, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFileError) as caught:
        traces.load([path])
    assert f"{tmp_path}/{where}" in str(caught.value) and problem in str(caught.value)


def test_missing_file_and_rootless_traces(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TraceFileError, match="no such file"):
        traces.load([tmp_path / "missing.jsonl"])
    with pytest.raises(TraceError, match="driver's trace file"):
        traces.load([run_dir / "trainer-0.jsonl", run_dir / "engine.jsonl"])


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_timeline_draws_a_picture(run_dir: Path, tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    output = tmp_path / f"step{suffix}"
    timeline.draw_timeline(traces.load([run_dir]).step(1), output)
    head = output.read_bytes()[:200]
    assert head.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in output.read_bytes()
    assert len(head) > 0


def test_timeline_refuses_unknown_suffix_and_picks_steps(run_dir: Path, tmp_path: Path) -> None:
    loaded = traces.load([run_dir])
    with pytest.raises(TraceError, match=r"use \.png or \.svg"):
        timeline.draw_timeline(loaded.step(), tmp_path / "step.pdf")
    assert loaded.step().number == 2
    with pytest.raises(TraceError, match=r"no step 7; steps found: 1–2"):
        loaded.step(7)


runner = CliRunner()


def test_cli_summarize_table_and_json(run_dir: Path) -> None:
    result = runner.invoke(app, ["trace", "summarize", str(run_dir)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "update_weights" in result.output and " 1 +30.0 " in result.output
    assert "2 step(s) (1–2), wall 1.400 s" in result.output
    result = runner.invoke(app, ["trace", "summarize", *map(str, sorted(run_dir.glob("*.jsonl"))), "--json"])
    assert result.exit_code == 0, result.output
    numbers = json.loads(result.stdout)
    update = next(p for p in numbers["phases"] if p["event"] == "update_weights")
    assert update["p50_ms"] == pytest.approx(150) and update["p95_ms"] == pytest.approx(195)
    assert update["slowest_rank"] == {"rank": 1, "over_fastest_ms": pytest.approx(30)}
    assert update["bytes_per_step"] == {"moved": 1000} and numbers["steps"] == [1, 2]


def test_cli_timeline_and_its_errors(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    output = tmp_path / "step.svg"
    result = runner.invoke(app, ["trace", "timeline", str(run_dir), "--output", str(output), "--step", "1"])
    assert result.exit_code == 0, result.output
    assert output.stat().st_size > 0 and "step 1" in result.output
    folder = tmp_path / "a-folder.png"
    folder.mkdir()
    for args, message in (
        (["--output", str(tmp_path / "step.gif")], "use a .png or .svg file"),
        (["--output", str(tmp_path / "nowhere" / "step.png")], "does not exist"),
        (["--output", str(output), "--step", "9"], "no step 9"),
        (["--output", str(tmp_path)], "use a .png or .svg file"),
        (["--output", str(folder)], f"cannot write {folder}"),
    ):
        result = runner.invoke(app, ["trace", "timeline", str(run_dir), *args])
        assert result.exit_code == 1 and message in result.output, result.output
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    result = runner.invoke(app, ["trace", "summarize", str(tmp_path / "bad.jsonl")])
    assert result.exit_code == 1 and "bad.jsonl:1: not JSON" in result.output


def test_work_only_rank_0_does_has_no_slowest_rank() -> None:
    alone = traces.PhaseSummary("update_weights", (5.0,), (0,), (0,), rank_ms={0: 5.0}, bytes={})
    assert alone.slowest_rank is None and alone.to_json()["slowest_rank"] is None
    both = traces.PhaseSummary("train", (9.0,), (0,), (0,), rank_ms={0: 5.0, 1: 7.0}, bytes={})
    assert both.slowest_rank == (1, pytest.approx(2.0))


def test_the_table_fits_80_columns_without_cutting_bytes() -> None:
    restore = traces.PhaseSummary(
        "update_weights",
        (11525.3, 234.5, 14947.9),
        (0, 0, 0),
        (0, 0, 0),
        {0: 1.0, 1: 1234.5},
        {"retaken": 1_600_000, "rebuilt": 301_568},
    )  # a loaded machine's seconds-long steps
    spark = tuple(float(i) for i in range(30))
    many = traces.PhaseSummary("train", spark, (0,) * 30, (0,) * 30, {0: 1.0, 1: 2.0}, {"moved": 987_654_321})
    for summary, sizes in (
        (traces.Summary((1, 2, 3), (1.0, 1.0, 1.0), 3.0, (restore,), 0), ["retaken 1.53M", "rebuilt 294K"]),
        (traces.Summary(tuple(range(1, 31)), (1.0,) * 30, 30.0, (many,), 0), ["moved 942M"]),
    ):
        text = _render(traces.summary_table(summary))
        assert max(len(line) for line in text.splitlines()) <= 80, text
        assert "…" not in text and all(size in text for size in sizes), text


def _render(table: Any) -> str:
    from rich.console import Console

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


def test_timeline_colours_follow_the_span_family_in_every_step(run_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    loaded = traces.load([run_dir])
    first, second = (timeline._colors(step) for step in loaded.steps)
    assert {n: first[n] for n in first.keys() & second.keys()} == {n: second[n] for n in first.keys() & second.keys()}
    assert timeline.family("rank.cast") == timeline.family("rank.gather") == "rebuild"
    assert first["rank.bucket"] == first["engine.update_weights"] == first["rank.push_weights"]
    assert first["rank.train"] != first["rank.bucket"]


def test_a_failed_attempt_is_counted_apart_from_the_timings_and_bytes(tmp_path: Path) -> None:
    """Step 2's restore raised after moving part of its bytes, and the fault followed: neither its
    time nor its bytes reach p50, p95 or the bytes per step, and the table says it failed."""
    driver = Process(tmp_path, "driver", "driver")
    for number, fails in ((1, False), (2, True), (3, False)):
        base = (number - 1) * 1000
        root = driver.start("colocate.step", None, base, **{"colocate.step": number})
        restore = driver.start("lifecycle.restore", root, base, **{"colocate.bytes_rebuilt": 300 if fails else 900})
        if fails:
            restore.set_status(Status(StatusCode.ERROR, "rank 1 died"))
        restore.end(end_time=T0 + (base + (5 if fails else 100)) * MS)
        if fails:
            fault = driver.start("lifecycle.fault", root, base + 5, **{"colocate.destination": "FAULTED"})
            fault.set_status(Status(StatusCode.ERROR, "rank 1 died"))
            fault.end(end_time=T0 + (base + 6) * MS)
            root.set_status(Status(StatusCode.ERROR, "rank 1 died"))
        root.end(end_time=T0 + (base + 200) * MS)
    driver.provider.shutdown()
    summary = traces.summarize(traces.load([tmp_path]))
    restore = next(p for p in summary.phases if p.event == "restore")
    assert restore.failed == (0, 1, 0) and restore.refused == (0, 0, 0)
    assert restore.durations_ms == pytest.approx((100, None, 100))
    assert restore.p50_ms == pytest.approx(100) and restore.p95_ms == pytest.approx(100)
    assert restore.bytes == {"rebuilt": 900}
    fault = next(p for p in summary.phases if p.event == "fault")
    assert fault.failed == (0, 0, 0) and fault.durations_ms[1] == pytest.approx(1)  # the fault did what it set out to
    table = _render(traces.summary_table(summary))
    assert "1 failed" in table
    assert summary.to_json()["phases"][0]["failed"] == [0, 1, 0]


def write_faulted_step(folder: Path) -> Path:
    """A 9 s step: short phases, the driver's check, then a restore that fails as rank 1 dies."""
    folder.mkdir(exist_ok=True)
    driver = Process(folder, "driver", "driver")
    rank = Process(folder, "trainer-0", "rank", rank=0)
    root = driver.start("colocate.step", None, 0, **{"colocate.step": 4})
    for name, start, end in (("pause_grads", 0, 3), ("update_weights", 3, 40), ("drop_params", 60, 62)):
        driver.span(f"lifecycle.{name}", root, start, end, **{"colocate.event": name})
    check = driver.span("colocate.engine_matches_trainer", root, 40, 60)
    rank.span("rank.converted_digests", check, 41, 59)
    driver.span("lifecycle.rollout", root, 62, 8900)
    restore = driver.start("lifecycle.restore", root, 8900)
    restore.set_status(Status(StatusCode.ERROR, "rank 1 (died) failed in rebuild"))
    restore.end(end_time=T0 + 8990 * MS)
    cause = "RankFailed: rank 1 (died) failed in rebuild: the process ended (SIGKILL)"
    fault = driver.start("lifecycle.fault", root, 8990, **{"colocate.cause": cause, "colocate.destination": "FAULTED"})
    fault.set_status(Status(StatusCode.ERROR, cause))
    fault.end(end_time=T0 + 8991 * MS)
    root.set_status(Status(StatusCode.ERROR, cause))
    root.end(end_time=T0 + 9000 * MS)
    driver.provider.shutdown()
    rank.provider.shutdown()
    return folder


def _texts(figure: Any) -> list[str]:
    return [t.get_text() for axes in figure.axes for t in [*axes.texts, axes.title, axes._left_title]]


def test_a_faulted_step_says_so_and_every_phase_reads_whatever_its_length(tmp_path: Path) -> None:
    """Issue 26 item 10: the title names the fault and its cause, a red line marks it in every row,
    each phase is labelled with its own duration below however thin its bar, the driver's own
    check is drawn on its row, and the legend lists the work families in their fixed order."""
    pytest.importorskip("matplotlib")
    step = traces.load([write_faulted_step(tmp_path / "t")]).steps[0]
    figure = timeline.timeline_figure(step)
    texts = _texts(figure)
    title = next(t for t in texts if t.startswith("step 4"))
    assert "FAULTED after 9000.0 ms" in title and "rank 1 (died) failed in rebuild" in title
    for label in ("pause_grads\n3.00 ms", "update_weights\n37.0 ms", "drop_params\n2.00 ms", "rollout\n8.84 s"):
        assert label in texts, texts
    assert "restore\n90.0 ms failed" in texts and "fault\n1.00 ms" in texts
    top = figure.axes[0]
    assert any(line.get_color() == "firebrick" and line.get_xdata()[0] == pytest.approx(8990) for line in top.lines)
    boxes = [path.get_extents() for bars in top.collections for path in bars.get_paths()]
    driver_bars = sorted(round(b.width, 1) for b in boxes if abs(b.y0 + b.y1) < 1e-6 and b.height == pytest.approx(0.7))
    least = 0.004 * 9000  # timeline.MIN_WIDTH of the axis: the 3, 2 and 1 ms phases would vanish
    assert driver_bars == pytest.approx([20.0, least, least, least, 37.0, 90.0, 8838.0]), driver_bars
    driver_row = timeline._rows(step)[0][1]
    assert "colocate.engine_matches_trainer" in {s.name for s in driver_row}
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend == ["digests"]


def test_the_legend_lists_families_in_their_fixed_order(run_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    figure = timeline.timeline_figure(traces.load([run_dir]).step(2))
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend == [f for f in timeline.FAMILIES if f in legend] and legend == ["weight sync", "train"]
    assert timeline.family("POST /update_weights_from_tensor") == "weight sync"
    assert timeline.family("POST /generate") == "rollout"
