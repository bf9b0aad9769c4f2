"""`colocate trace` on files it did not write in this session: the committed sample still reads,
a malformed file is a clear error. A run's own --trace-dir file is read in test_cli_run.py, beside
the run that writes it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trace_check import processes_per_trace

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def colocate(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("colocate")
    command = [exe] if exe else [sys.executable, "-m", "orchestrator.cli"]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_committed_sample_still_reads() -> None:
    sample = ROOT / "traces" / "sample.otlp.jsonl"
    assert len(processes_per_trace(sample)) >= 3
    assert colocate("trace", "summarize", str(sample)).returncode == 0


def test_a_malformed_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.otlp.jsonl"
    bad.write_text('{"resourceSpans": []}\n{oops\n')
    done = colocate("trace", "summarize", str(bad))
    assert done.returncode != 0
    assert f"{bad}:2" in " ".join(done.stderr.split()) and "not JSON" in done.stderr
