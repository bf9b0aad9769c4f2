"""The restore cast on the CPU: Megatron's own loop runs (no Triton kernel here), and the pairs
the kernel would cast are exactly the ones Megatron's loop writes, at DP=1 and DP=2 over gloo."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.spawn import spawn_ranks

pytestmark = pytest.mark.slow


def _snapshot(trainer: Any) -> list[torch.Tensor]:
    return [t.clone() for t in trainer.region_tensors()["param_buffer"]]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _poison(trainer: Any) -> None:
    for tensor in trainer.region_tensors()["param_buffer"]:
        tensor.fill_(float("nan"))


def _scenario(rank: int, world_size: int, port: int, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        from orchestrator.adapters.megatron.build import (
            TinyGPTConfig,
            build_gpt,
            destroy_process_group,
            init_process_group,
            train_step,
        )
        from orchestrator.adapters.megatron.fast_cast import MainParamCast, cast_pairs, kernel_available
        from orchestrator.adapters.megatron.trainer import MegatronTrainer

        init_process_group(rank, world_size, port)
        cfg = TinyGPTConfig(num_experts=2, fp32_param=True, frozen_param=True)
        chunks, optimizer = build_gpt(cfg)
        train_step(chunks, optimizer, torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1)))
        trainer = MegatronTrainer(chunks, optimizer)
        result["kernel_available"] = kernel_available()
        result["path"] = trainer.cast.path
        try:
            MainParamCast(trainer._optimizers, use_kernel=True)
        except RuntimeError as error:
            result["forced"] = str(error)
        # Megatron's loop, then the pairs the kernel is given, copied one by one, each onto NaN.
        _poison(trainer)
        trainer.cast_mains()
        megatron = _snapshot(trainer)
        _poison(trainer)
        halves = fp32 = 0
        for opt in trainer._optimizers:
            plan = cast_pairs(opt)
            assert plan is not None
            for src, dst in (*plan[0], *plan[1]):
                dst.copy_(src)
            halves, fp32 = halves + len(plan[0]), fp32 + len(plan[1])
        result["pairs"] = [halves, fp32]
        result["bf16_params"] = sum(1 for p in chunks[0].parameters() if p.requires_grad and p.dtype == torch.bfloat16)
        planned = _snapshot(trainer)
        # NaN != NaN: compare the bits; padding never written stays NaN on both sides.
        result["same_bits"] = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(megatron, planned, strict=True))
        result["written"] = sum(int((~t.isnan()).sum()) for t in planned)
        destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _run(world_size: int, out: Path) -> list[dict[str, Any]]:
    return spawn_ranks(_scenario, world_size, out, timeout=240)


@pytest.mark.parametrize("world_size", [1, 2])
def test_cpu_uses_megatrons_loop_and_the_kernels_pairs_match_it(world_size: int, tmp_path: Path) -> None:
    ranks = _run(world_size, tmp_path)
    for rank in ranks:
        assert rank["kernel_available"] is False
        assert rank["path"] == "megatron"
        assert "cannot run here" in rank["forced"]
        assert rank["written"] > 0
        assert rank["same_bits"]
    # every trained bf16 param has its shard(s) on some rank (a param split by the shard
    # boundary counts on both), and the fp32 scale too
    halves = sum(r["pairs"][0] for r in ranks)
    assert ranks[0]["bf16_params"] <= halves <= ranks[0]["bf16_params"] + world_size - 1
    assert sum(r["pairs"][1] for r in ranks) >= 1
