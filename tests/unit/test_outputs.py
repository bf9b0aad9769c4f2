"""`colocate run`'s output paths, tried by writing before any rank starts (orchestrator/job/outputs.py):
each refusal names the option, the path and the OS's reason, and a trial leaves nothing behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.job.outputs import output_problems


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """The runs `colocate run` started: none, where an output is refused."""
    import orchestrator.job.run as demo_run

    runs: list[object] = []

    def run(config: object, **_: object) -> int:
        runs.append(config)
        return 0

    monkeypatch.setattr(demo_run, "run", run)
    yield runs


# Paths a permission check passes for root, that no write reaches (found as root, 2026-12-01).
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--trace-dir", "/proc/t"], "--trace-dir /proc/t: cannot write there: No such file or directory"),
        (["--report", "/proc/r.json"], "--report /proc/r.json: cannot write there: No such file or directory"),
        (["--log", "/sys/x.log"], "--log /sys/x.log: cannot write there: "),
        (["--log", "/dev/full"], "--log /dev/full: cannot write there: No space left on device"),
        (["--report", "/dev/full"], "--report /dev/full: not a regular file"),
    ],
)
def test_an_output_no_write_reaches_is_refused_before_the_run(
    args: list[str], problem: str, started: list[object]
) -> None:
    done = CliRunner().invoke(app, ["run", *args])
    assert done.exit_code == 2, done.output
    assert problem in " ".join(done.output.split()), done.output
    assert started == []


def test_a_new_file_or_folder_is_tried_and_removed(tmp_path: Path) -> None:
    found = output_problems(report=tmp_path / "r.json", log=tmp_path / "l.jsonl", trace_dir=tmp_path / "a" / "b" / "c")
    assert found == []
    assert list(tmp_path.iterdir()) == []


def test_existing_files_are_left_as_they_were(tmp_path: Path) -> None:
    report, log, traces = tmp_path / "r.json", tmp_path / "l.jsonl", tmp_path / "traces"
    report.write_text('{"kept": true}\n')
    log.write_text('{"event": "train"}\n')
    traces.mkdir()
    (traces / "old.otlp.jsonl").write_text("{}\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (report, log, traces / "old.otlp.jsonl")}
    assert output_problems(report=report, log=log, trace_dir=traces) == []
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in before} == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["l.jsonl", "old.otlp.jsonl", "r.json", "traces"]


def test_a_log_may_go_to_a_pipe_with_a_reader_or_a_terminal_but_a_report_may_not(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert output_problems(report=None, log=pipe, trace_dir=None) == [
        f"--log {pipe}: cannot write there: No such device or address"  # no reader: the run would wait forever
    ]
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert output_problems(report=None, log=pipe, trace_dir=None) == []
        assert os.read(reader, 1) == b""  # nothing was written to it
    finally:
        os.close(reader)
    assert output_problems(report=None, log=Path("/dev/null"), trace_dir=None) == []
    assert output_problems(report=Path("/dev/null"), log=None, trace_dir=None) == [
        "--report /dev/null: not a regular file"
    ]
