"""Adam's state is made at set-up (`build.init_optimizer_state`), not by the first step (issue 40
item 2): the `default` region's storages are final before the first pause, so its host arena is
laid out once; and the steps are bit for bit those of an optimizer whose first step makes the
state itself, on 1 and 2 real Megatron-core ranks (gloo, CPU)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.support.spawn import spawn_ranks

pytest.importorskip("megatron.core")

STEPS = 3


def _scenario(rank: int, world_size: int, port: int, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        import torch

        from orchestrator.adapters.megatron.build import (
            TinyGPTConfig,
            build_gpt,
            destroy_process_group,
            init_process_group,
            train_step,
        )
        from orchestrator.adapters.megatron.trainer import MegatronTrainer
        from orchestrator.adapters.regions.storage import storages_by_tag

        def default_storages(trainer: MegatronTrainer) -> list[tuple[int, int]]:
            return [(s._cdata, s.nbytes()) for s in storages_by_tag(trainer.region_tensors())["default"]]

        init_process_group(rank, world_size, port)
        cfg = TinyGPTConfig(num_experts=2, fp32_param=True)
        batches = [torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(s))
                   for s in range(STEPS)]  # fmt: skip
        runs = []
        for lazy in (False, True):
            chunks, optimizer = build_gpt(cfg)
            if lazy:  # as Megatron leaves it: no state until the first step makes it
                for inner in optimizer.chained_optimizers:
                    inner.optimizer.state.clear()
            trainer = MegatronTrainer(chunks, optimizer)
            before = default_storages(trainer)
            for tokens in batches:
                train_step(chunks, optimizer, tokens)
            result["same_storages" if not lazy else "lazy_same_storages"] = default_storages(trainer) == before
            runs.append([p.detach().float().clone() for p in chunks[0].parameters()])
        result["bit_identical"] = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
        result["params"] = len(runs[0])
        destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("world_size", [1, 2])
def test_adams_state_is_there_before_the_first_step_and_changes_no_step(world_size: int, tmp_path: Path) -> None:
    for result in spawn_ranks(_scenario, world_size, tmp_path, timeout=240):
        assert result["same_storages"], "the default region's storages changed at a step"
        assert not result["lazy_same_storages"], "the check cannot fail: a lazy optimizer's storages did not change"
        assert result["bit_identical"] and result["params"] > 0
