"""The job with two ranks (Ray actors, CPU) against one SGLang server at TP 2: each TP rank's
payload is serialized by the rank on its GPU, from that rank's process (`fanout.PerTpRankPush`).

The server is the stand-in (tests/support/sglang_server.py) in this process, serving a
transformers Llama; it records which process shared each payload's memory. On GPUs the payloads
would name each rank's GPU by UUID instead: not run here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from orchestrator.adapters.digest import sha256_digests
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.core.config import EngineKind
from orchestrator.job.config import Engine
from orchestrator.job.grpo import GRPOConfig
from orchestrator.job.job import ColocatedJob, RunConfig
from orchestrator.telemetry.listeners import Listener, TransitionRecord
from states import Event
from tests.support.sglang_server import SGLangStandIn

pytestmark = pytest.mark.slow


class AtSync(Listener):
    """Right after the sync: the digests of what the server loaded and of rank 0's converted weights."""

    def __init__(self, server: SGLangStandIn, job: list[ColocatedJob]) -> None:
        self.server, self.job = server, job
        self.digests: tuple[dict[str, str], dict[str, str]] | None = None

    def on_transition(self, record: TransitionRecord) -> None:
        if record.event is Event.UPDATE_WEIGHTS:
            self.digests = sha256_digests(self.server.state.loaded), self.job[0].trainer.converted_digests()


def test_each_tp_rank_gets_the_payload_of_the_rank_on_its_gpu() -> None:
    grpo = GRPOConfig()
    model = TransformersEngine(grpo.model, max_batch=grpo.prompts_per_step * grpo.group_size)
    holder: list[ColocatedJob] = []
    with SGLangStandIn(tp_size=2, model=model) as server:
        at_sync = AtSync(server, holder)
        config = RunConfig(
            engine=Engine(kind=EngineKind.SGLANG, urls=(server.url,), bucket_bytes=1 << 15), ranks=2, steps=1, grpo=grpo
        )  # buckets of 32 KiB: the ranks walk several together
        with ColocatedJob(config, listeners=[at_sync]) as job:
            holder.append(job)
            job.run_step()
            pids = job.trainer.ranks.pids
        origins, version = server.state.payload_origins, server.state.weight_version
    assert len(origins) > 1 and all(o == [f"pid {pids[0]}", f"pid {pids[1]}"] for o in origins), (pids, origins)
    assert at_sync.digests is not None
    loaded, converted = at_sync.digests
    assert loaded == converted  # every weight arrived, whole
    assert version == "1"
