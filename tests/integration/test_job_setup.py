"""The job's config guards judge the Megatron flags its ranks really built with (issue 10 item 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.spawn import context

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


def _job_with_overlapping_param_gather(out: str) -> None:
    """In a fresh process (the in-process rank owns torch.distributed for the process's life):
    ranks whose DDP config overlaps the param gather, as a Megatron run with that flag would."""
    import orchestrator.adapters.megatron.build as build
    from orchestrator.errors import ConfigError
    from orchestrator.job.job import ColocatedJob, RunConfig

    real = build.build_gpt

    def overlapping(cfg, **kwargs):  # type: ignore[no-untyped-def]
        chunks, optimizer = real(cfg, **kwargs)
        for chunk in chunks:
            chunk.ddp_config.overlap_param_gather = True
        return chunks, optimizer

    build.build_gpt = overlapping
    try:
        with ColocatedJob(RunConfig(steps=1, ranks=1)):
            pass
        Path(out).write_text("accepted")
    except ConfigError as error:
        Path(out).write_text(str(error))


def test_overlap_param_gather_in_the_real_ddp_config_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "result.txt"
    process = context().Process(target=_job_with_overlapping_param_gather, args=(str(out),))
    process.start()
    process.join(240)
    if process.is_alive():
        process.kill()
        pytest.fail("the job did not start or refuse within 240 s")
    text = out.read_text()
    assert "no_overlap_param_gather" in text, text
