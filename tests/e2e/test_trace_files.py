"""`--trace-dir` as a user would use it: OTLP/JSON that parses through the official mapping, one
trace per step with spans from both ranks and the engine, read back by `colocate trace`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from orchestrator.telemetry.tracing import parse_otlp_json
from tests.support.trace_check import edges

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def colocate(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("colocate")
    command = [exe] if exe else [sys.executable, "-m", "orchestrator.cli"]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("traces")
    done = colocate("run", "--steps", "2", "--ranks", "2", "--trace-dir", str(out))
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("*.otlp.jsonl")
    return path


def processes_per_trace(path: Path) -> dict[str, set[tuple[str, int | None]]]:
    """The processes with spans in each step's trace (the start-up's trace is not a step's)."""
    seen: dict[str, set[tuple[str, int | None]]] = defaultdict(set)
    steps: set[str] = set()
    for line in path.read_text().splitlines():
        for resource in parse_otlp_json(line).resource_spans:
            where = {a.key: a.value for a in resource.resource.attributes}
            rank = where["colocate.rank"].int_value if "colocate.rank" in where else None  # the engine has none
            process = (where["colocate.role"].string_value, rank)
            for scope in resource.scope_spans:
                for span in scope.spans:
                    seen[span.trace_id.hex()].add(process)
                    if span.name == "colocate.step":
                        steps.add(span.trace_id.hex())
    return {trace: processes for trace, processes in seen.items() if trace in steps}


def test_every_step_is_one_trace_across_ranks_and_engine(trace_file: Path) -> None:
    full = {("driver", 0), ("rank", 0), ("rank", 1), ("engine", None)}
    assert list(processes_per_trace(trace_file).values()) == [full, full]


def test_summarize_and_timeline_read_it(trace_file: Path, tmp_path: Path) -> None:
    summary = colocate("trace", "summarize", str(trace_file))
    assert summary.returncode == 0, summary.stderr
    assert "update_weights" in summary.stdout and "2 step(s)" in summary.stdout
    picture = tmp_path / "step.svg"
    drawn = colocate("trace", "timeline", str(trace_file), "--output", str(picture))
    assert drawn.returncode == 0, drawn.stderr
    assert picture.read_text().lstrip().startswith("<?xml")


def test_the_committed_sample_still_reads() -> None:
    sample = ROOT / "traces" / "sample.otlp.jsonl"
    assert len(processes_per_trace(sample)) >= 3
    assert colocate("trace", "summarize", str(sample)).returncode == 0


def test_the_committed_sample_has_the_span_tree_of_a_fresh_run(trace_file: Path) -> None:
    """docs/tracing.md's tree is the sample's (tests/docs); this keeps the sample a run's of today."""
    sample, fresh = edges(ROOT / "traces" / "sample.otlp.jsonl"), edges(trace_file)
    assert fresh - sample == set(), f"a fresh run has parent-child pairs the sample lacks: {sorted(fresh - sample)}"
    assert sample - fresh == set(), f"the sample has parent-child pairs a fresh run lacks: {sorted(sample - fresh)}"


def test_a_malformed_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.otlp.jsonl"
    bad.write_text('{"resourceSpans": []}\n{oops\n')
    done = colocate("trace", "summarize", str(bad))
    assert done.returncode != 0
    assert f"{bad}:2" in " ".join(done.stderr.split()) and "not JSON" in done.stderr
