"""Bad output paths and numbers given to `colocate run`: exit 2 naming the problem, before any rank
starts (so no Ray session folder appears) and without touching what the path names."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import ROOT, colocate


def run_in(temp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(temp)}
    return subprocess.run(colocate("run", *args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def temp() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="ci-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


CASES = {
    "report is a folder": (lambda d: ["--report", str(d)], "is a folder; name a file"),
    "log is a folder": (lambda d: ["--log", str(d)], "is a folder; name a file"),
    "report in a missing folder": (lambda d: ["--report", str(d / "no" / "r.json")], "does not exist"),
    "trace dir under a file": (lambda d: ["--trace-dir", str(d / "file" / "traces")], "file is a file, not a folder"),
    "trace dir is a file": (lambda d: ["--trace-dir", str(d / "file")], "exists and is not a folder"),
    "report and log the same": (
        lambda d: ["--report", str(d / "x"), "--log", str(d / "x")],
        "--report and --log name the same file",
    ),
    "rank timeout nan": (lambda d: ["--rank-timeout", "nan"], "--rank-timeout must be a positive number"),
    "rank timeout inf": (lambda d: ["--rank-timeout", "inf"], "--rank-timeout must be a positive number"),
    "rank timeout negative": (lambda d: ["--rank-timeout", "-1"], "--rank-timeout must be a positive number"),
    "unknown model": (
        lambda d: ["--model", "gpt-5"],
        "--model: gpt-5: no such config.json, and not a preset (tiny, qwen-0.5b, llama-1b) or a seed workload (qwen3-4b, deepseek-v3, glm-5)",
    ),
    "seed negative": (lambda d: ["--seed", "-3"], "--seed must be >= 0"),
    "more ranks than any machine holds": (lambda d: ["--ranks", "2048"], "--ranks 2048: a rank needs a CPU core"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_output_or_number_is_refused_before_any_rank_starts(case: str, temp: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("keep me\n")
    args, problem = CASES[case]
    done = run_in(temp, *args(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert problem in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr
    assert list(temp.iterdir()) == []  # Ray never started
    assert (tmp_path / "file").read_text() == "keep me\n" and list(tmp_path.iterdir()) == [tmp_path / "file"]


def test_every_problem_is_named_at_once(temp: Path, tmp_path: Path) -> None:
    done = run_in(temp, "--report", str(tmp_path), "--rank-timeout", "nan", "--steps", "0")
    assert done.returncode == 2
    assert "3 configuration problem(s)" in done.stderr, done.stderr


EXPORTER_CASES = {
    "zipkin": ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin': colocate exports to otlp"),
    "http/json": (
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
        "OTEL_EXPORTER_OTLP_PROTOCOL='http/json': colocate speaks OTLP over http/protobuf and grpc",
    ),
    "endpoint without a scheme": (
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4318"},
        "OTEL_EXPORTER_OTLP_ENDPOINT='localhost:4318': not a URL with http:// or https:// and a host "
        "(say http://localhost:4318)",
    ),
}


@pytest.mark.parametrize("case", EXPORTER_CASES)
def test_an_exporter_colocate_cannot_use_is_refused_in_one_line(case: str, temp: Path) -> None:
    variables, problem = EXPORTER_CASES[case]
    env = {**os.environ, "TMPDIR": str(temp), **variables}
    done = subprocess.run(colocate("run"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert problem in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 3, done.stderr
    assert list(temp.iterdir()) == []  # Ray never started
