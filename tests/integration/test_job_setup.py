"""The job's config guards judge the Megatron flags its ranks really built with (issue 10 item 11)."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def _in_a_fresh_process(job: Callable[[str], None], out: Path) -> str:
    """What `job` wrote to `out`, run in a process of its own within 240 s."""
    process = context().Process(target=job, args=(str(out),))
    process.start()
    process.join(240)
    if process.is_alive():
        process.kill()
        pytest.fail("the job did not start or refuse within 240 s")
    return out.read_text()


def test_overlap_param_gather_in_the_real_ddp_config_is_refused(tmp_path: Path) -> None:
    text = _in_a_fresh_process(_job_with_overlapping_param_gather, tmp_path / "result.txt")
    assert "no_overlap_param_gather" in text, text


def _job_serving_another_config(ranks: int, out: str) -> None:
    """In a fresh process: a family model whose served config (what the engine builds) has another
    norm eps than the model the ranks build, in this process (1 rank) or in Ray actors (2)."""
    import transformers

    from orchestrator.adapters.megatron.gpt import GPTConfig
    from orchestrator.errors import ConfigError
    from orchestrator.job.grpo import GRPOConfig, TaskConfig
    from orchestrator.job.job import ColocatedJob, RunConfig
    from orchestrator.models import read_config

    sizes = dict(vocab_size=32, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    built = transformers.Qwen3Config(**sizes, intermediate_size=64, num_hidden_layers=1, rms_norm_eps=1e-6)
    served = {**built.to_dict(), "rms_norm_eps": 1e-5}
    model = GPTConfig(model=read_config(built.to_dict(), source="built"), served=served)
    grpo = GRPOConfig(model=model, task=TaskConfig(vocab_size=32), prompts_per_step=2, group_size=2)
    try:
        with ColocatedJob(RunConfig(steps=1, ranks=ranks, grpo=grpo)):
            pass
        Path(out).write_text("accepted")
    except ConfigError as error:
        Path(out).write_text(str(error))
    except Exception as error:  # a refusal that is not a ConfigError would exit 1, not 2
        Path(out).write_text(f"not a ConfigError: {type(error).__name__}: {error}")


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_rank_refuses_a_family_model_whose_served_config_computes_otherwise(ranks: int, tmp_path: Path) -> None:
    """Before any weight is sent: the rank's Megatron model against the config the engine builds.
    At 2 ranks the refusal is raised in a Ray actor's construction, and reaches the driver as the
    ConfigError it is (bad input, exit 2), not as a rank that died."""
    text = _in_a_fresh_process(functools.partial(_job_serving_another_config, ranks), tmp_path / "result.txt")
    assert "rms_norm_eps" in text, text
