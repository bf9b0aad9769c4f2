"""On GPUs: the Triton restore cast is bit-identical to Megatron's, and restores under
torch_memory_saver (Megatron's all-gather, and the pipelined exchange at DP=2) give back the
exact params on every rank."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.spawn import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _awkward_floats(n: int, generator: torch.Generator) -> torch.Tensor:
    """Normal values over many magnitudes, bf16 rounding ties, subnormals, ±0, ±inf and NaN."""
    values = torch.randn(n, generator=generator) * torch.exp2(
        torch.randint(-130, 120, (n,), generator=generator).float()
    )
    ties = (torch.randint(0, 1 << 16, (n,), generator=generator, dtype=torch.int32) << 16) | 0x8000
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-40, 3.4e38])
    pick = torch.randint(0, 4, (n,), generator=generator)
    values = torch.where(pick == 1, ties.view(torch.float32), values)
    values = torch.where(pick == 2, special[torch.randint(0, len(special), (n,), generator=generator)], values)
    return values


def test_kernel_casts_like_copy_on_awkward_values() -> None:
    from orchestrator.adapters.megatron.fast_cast import _Launch, kernel_available

    if not kernel_available():
        pytest.skip("Triton is not importable")
    generator = torch.Generator().manual_seed(0)
    sizes = [1, 7, 4095, 4096, 4097, 65_536 + 3, 1_000_003]
    srcs = [_awkward_floats(n, generator).cuda() for n in sizes]
    flat = torch.empty(sum(sizes) + 64, dtype=torch.bfloat16, device="cuda")
    for offset in (0, 1):  # 16-byte-aligned destinations, then misaligned ones
        flat.fill_(float("nan"))
        dsts, start = [], offset
        for n in sizes:
            dsts.append(flat[start : start + n])
            start += n + (8 - n % 8) % 8 if offset == 0 else n
        launch = _Launch(list(zip(srcs, dsts, strict=True)), block=4096)
        launch()
        torch.cuda.synchronize()
        assert launch._aligned is (offset == 0)
        for src, dst in zip(srcs, dsts, strict=True):
            assert torch.equal(_bits(dst), _bits(src.to(torch.bfloat16))), f"{src.numel()} elements at offset {offset}"


def _scenario(rank: int, world_size: int, port: int, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        from guards.bitexact import restore_bit_identical
        from orchestrator.adapters.digest import DigestMethod
        from orchestrator.adapters.megatron.build import (
            TinyGPTConfig,
            build_gpt,
            destroy_process_group,
            init_process_group,
            train_step,
        )
        from orchestrator.adapters.megatron.fast_cast import MainParamCast, PipelinedRestore
        from orchestrator.adapters.megatron.trainer import MegatronTrainer
        from orchestrator.adapters.regions.tms import TorchMemorySaverRegions
        from orchestrator.core.regions import RegionLedger
        from states import Mode, Region

        init_process_group(rank, world_size, port, "nccl")
        cfg = TinyGPTConfig(hidden_size=256, num_layers=3, num_attention_heads=8, num_query_groups=4,
                            ffn_hidden_size=768, vocab_size=4096, num_experts=2, fp32_param=True, frozen_param=True)  # fmt: skip
        chunks, optimizer = build_gpt(cfg)
        generator = torch.Generator().manual_seed(rank)

        def step() -> None:
            train_step(chunks, optimizer, torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=generator))

        step()
        trainer = MegatronTrainer(chunks, optimizer, digest=DigestMethod.DEVICE)
        result["path"] = trainer.cast.path
        ledger = RegionLedger(TorchMemorySaverRegions(trainer.region_tensors))
        restores = {"remat": lambda: trainer.rebuild(Mode.REMATERIALIZE)}
        if world_size > 1:
            for exchange in ("broadcast", "p2p"):  # small pieces: many of them
                pipelined = PipelinedRestore(chunks, trainer.cast, piece_bytes=64 << 10, exchange=exchange)
                restores[f"pipelined_{exchange}"] = lambda p=pipelined: (p(), trainer.copy_extras_back())
        for name, restore in restores.items():
            verdicts, freed = [], []
            for _ in range(2):
                before = dict(trainer.digests())
                trainer.stash(Mode.REMATERIALIZE)
                freed.append(
                    {tag.value: ledger.pause(tag) for tag in (Region.GRAD_BUFFER, Region.DEFAULT, Region.PARAM_BUFFER)}
                )
                for tag in (Region.DEFAULT, Region.GRAD_BUFFER, Region.PARAM_BUFFER):
                    ledger.resume(tag)
                for tensor in trainer.region_tensors()["param_buffer"]:
                    tensor.fill_(float("nan"))  # whatever the fresh pages held, it must not survive
                restore()
                torch.cuda.synchronize()
                verdicts.append(restore_bit_identical(before, trainer.digests()).reason)
                result[f"{name}_ok"] = result.get(f"{name}_ok", True) and verdicts[-1].endswith("bit-identical")
                step()
            result[name] = {"verdicts": verdicts, "freed": freed}
        result["param_buffer_bytes"] = sum(
            t.untyped_storage().nbytes() for t in trainer.region_tensors()["param_buffer"]
        )
        result["digests"] = dict(trainer.digests())
        # Last (it overwrites the mains): the kernel against Megatron's loop on awkward values.
        megatron = MainParamCast(trainer._optimizers, use_kernel=False)
        values = torch.Generator().manual_seed(10 + rank)
        for src, _ in megatron.pairs:
            src.copy_(_awkward_floats(src.numel(), values))
        snapshots = []
        for cast in (megatron, trainer.cast):
            for tensor in trainer.region_tensors()["param_buffer"]:
                tensor.fill_(float("nan"))
            cast()
            torch.cuda.synchronize()
            snapshots.append([_bits(t).clone() for t in trainer.region_tensors()["param_buffer"]])
        result["kernel_matches_megatron"] = all(torch.equal(a, b) for a, b in zip(*snapshots, strict=True))
        result["pairs"] = len(megatron.pairs)
        destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _run(world_size: int, out: Path) -> list[dict[str, Any]]:
    return spawn_ranks(_scenario, world_size, out, timeout=280)


@pytest.mark.parametrize("world_size", [1, 2])
def test_restores_bit_identical_under_torch_memory_saver_and_kernel_matches_megatron(
    world_size: int, tmp_path: Path
) -> None:
    pytest.importorskip("torch_memory_saver")
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    ranks = _run(world_size, tmp_path)
    for rank in ranks:
        assert rank["path"] == "triton"
        names = ("remat", "pipelined_broadcast", "pipelined_p2p") if world_size > 1 else ("remat",)
        for name in names:
            assert rank[f"{name}_ok"], rank[name]["verdicts"]
            for freed in rank[name]["freed"]:
                assert freed["param_buffer"] >= rank["param_buffer_bytes"], freed
        assert rank["kernel_matches_megatron"], "Triton cast differs from _copy_main_params_to_model_params"
        assert rank["pairs"] > 10
    assert all(r["digests"] == ranks[0]["digests"] for r in ranks), "data-parallel ranks hold different params"
