"""`run()` cleans up however the run ends: an error that is not the lifecycle's, or an exception
it does not handle at all. Afterwards the spans are flushed and merged into one trace file, the log
is closed, the tracer provider shut down, the report written, Ray and the actors gone, and the
exit code (or the exception itself) says the run failed.

Each run is in a process of its own (tests/support/spawn.py): it sets the global tracer provider and puts Ray's
driver in token mode, both for the life of its process."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import trace_check
from tests.support.spawn import context

psutil = pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
pytest.importorskip("ray")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


class Abort(BaseException):
    """Neither an error nor Ctrl-C: what `run` does not handle (as SystemExit), raised on."""


def _run_failing_at_step_2(folder: str, ranks: int, raise_: str) -> None:
    """In a fresh process: `run()` whose second step raises `raise_`, with spies on what it
    must close. Writes what it saw to `folder/seen.json`."""
    from rich.console import Console

    import orchestrator.job.ray_cluster as ray_cluster
    import orchestrator.job.run as run_module
    from orchestrator.job.grpo import GRPOConfig
    from orchestrator.job.job import ColocatedJob, RunConfig
    from orchestrator.job.presets import preset

    out = Path(folder)
    seen: dict[str, Any] = {"clusters": [], "shutdowns": 0, "logs": []}
    real_start, real_tracing, real_logging, real_step = (
        ray_cluster.start_private, run_module.configure_tracing, run_module.configure_logging, ColocatedJob.run_step,
    )  # fmt: skip

    def start_private(*args: Any, **kwargs: Any) -> Any:
        cluster = real_start(*args, **kwargs)
        seen["clusters"].append(str(cluster.temp_dir))
        return cluster

    def configure_tracing(**kwargs: Any) -> Any:
        provider = real_tracing(**kwargs)
        shutdown = provider.shutdown

        def counted() -> None:
            seen["shutdowns"] += 1
            shutdown()

        provider.shutdown = counted
        return provider

    logs: list[Any] = []

    def configure_logging(file: Any, **kwargs: Any) -> Any:
        logs.append(file)
        return real_logging(file, **kwargs)

    def run_step(job: ColocatedJob) -> Any:
        if job.report.steps and job.report.steps[-1].loss is not None:
            raise {"Abort": Abort("stopped from outside"), "RuntimeError": RuntimeError("not the lifecycle's")}[raise_]
        return real_step(job)

    ray_cluster.start_private = start_private  # type: ignore[assignment]
    run_module.configure_tracing = configure_tracing  # type: ignore[assignment]
    run_module.configure_logging = configure_logging  # type: ignore[assignment]
    ColocatedJob.run_step = run_step  # type: ignore[method-assign]
    config = RunConfig(steps=3, ranks=ranks, grpo=GRPOConfig(model=preset("tiny")))
    try:
        seen["code"] = run_module.run(
            config, report_path=out / "report.json", trace_dir=out / "traces", log_path=out / "log.jsonl",
            console=Console(file=io.StringIO()), err=Console(file=io.StringIO()),
        )  # fmt: skip
    except Abort as exc:
        seen["raised"] = str(exc)
    import ray

    seen["ray_initialized"] = ray.is_initialized()
    seen["logs_closed"] = [f.closed for f in logs]
    (out / "seen.json").write_text(json.dumps(seen))


def _run(tmp_path: Path, ranks: int, raise_: str) -> dict[str, Any]:
    process = context().Process(target=_run_failing_at_step_2, args=(str(tmp_path), ranks, raise_))
    process.start()
    process.join(400)
    if process.is_alive():
        process.kill()
        pytest.fail("the run did not end within 400 s")
    assert process.exitcode == 0, f"the run's process exited {process.exitcode}"
    return dict(json.loads((tmp_path / "seen.json").read_text()))


def _assert_cleaned_up(tmp_path: Path, seen: dict[str, Any], error: str) -> None:
    assert seen["shutdowns"] == 1, "the tracer provider was shut down once"
    assert seen["logs_closed"] == [True], "the log was closed"
    (merged,) = (tmp_path / "traces").iterdir()  # the per-process folder is gone, merged into one file
    assert merged.name.endswith(".otlp.jsonl") and not merged.name.startswith(".")
    spans = {
        span["name"]
        for line in merged.read_text().splitlines()
        for resource in json.loads(line)["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    }
    assert {"colocate.start", "lifecycle.train", "rank.train", "engine.generate"} <= spans, spans
    assert trace_check.whole(merged) == []
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines if line.get("step") == 1][-1] == "train", "the log has step 1 whole"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["error"].startswith(error) and report["trace_file"] == str(merged)
    assert [s["loss"] is not None for s in report["steps"]][:1] == [True]


def test_an_exception_run_does_not_handle_is_raised_after_ray_and_telemetry_are_closed(tmp_path: Path) -> None:
    seen = _run(tmp_path, ranks=2, raise_="Abort")
    assert seen["raised"] == "stopped from outside" and "code" not in seen
    _assert_cleaned_up(tmp_path, seen, "Abort: stopped from outside")
    assert seen["ray_initialized"] is False
    (temp_dir,) = seen["clusters"]
    from orchestrator.job.ray_reaper import head_processes

    assert not Path(temp_dir).exists(), "the private cluster's folder is removed"
    assert head_processes(Path(temp_dir)) == [], "no process of the private cluster (its actors too) is left"


def test_an_error_that_is_not_the_lifecycles_ends_the_run_with_exit_code_1(tmp_path: Path) -> None:
    seen = _run(tmp_path, ranks=1, raise_="RuntimeError")
    assert seen["code"] == 1 and "raised" not in seen
    _assert_cleaned_up(tmp_path, seen, "RuntimeError: not the lifecycle's")


def test_a_report_that_cannot_be_written_at_the_end_is_one_error_after_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried before the run, the report's place can still go during it (here its folder is removed
    after the step): the run ends with its summary, then one line that names the report, exit 1."""
    from rich.console import Console

    import orchestrator.job.run as run_module
    from orchestrator.job.grpo import GRPOConfig
    from orchestrator.job.job import ColocatedJob, RunConfig
    from orchestrator.job.presets import preset

    folder = tmp_path / "out"
    folder.mkdir()
    real_step = ColocatedJob.run_step

    def run_step(job: ColocatedJob) -> Any:
        outcome = real_step(job)
        folder.rmdir()
        return outcome

    monkeypatch.setattr(ColocatedJob, "run_step", run_step)
    said = io.StringIO()  # stdout and stderr in the order they were written
    console = Console(file=said, width=200, soft_wrap=True)
    config = RunConfig(steps=1, ranks=1, grpo=GRPOConfig(model=preset("tiny")))
    code = run_module.run(
        config, report_path=folder / "r.json", trace_dir=None, log_path=None, console=console, err=console
    )
    lines = said.getvalue().rstrip().splitlines()
    assert code == 1
    assert (
        lines[-1] == f"error: --report {folder / 'r.json'}: the report could not be written: No such file or directory"
    )
    assert any("colocate run: rematerialize, 1 rank(s), 1 steps done" in line for line in lines[:-1])
    assert "Traceback" not in said.getvalue()
