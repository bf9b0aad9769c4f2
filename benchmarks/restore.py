"""Restore a dropped bf16 param buffer both ways, side by side on one model, in one process.

- rematerialize: cast the fp32 mains to bf16 and all-gather; copy a few KB of extras back;
- backup: copy the pinned host copy of every bf16 param back (today's stacks).

The model is a Llama-shaped megatron-core GPT with an MoE layer (expert_bias), an fp32 param
and a frozen param, in DDP + DistributedOptimizer. On a GPU the regions are torch_memory_saver's
and a device-to-device copy of the same bytes is timed as the roofline for the cast.

    python benchmarks/restore.py [--preset cpu|gpu-1b] [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch

from guards.bitexact import restore_bit_identical
from orchestrator.adapters.digest import DigestMethod
from orchestrator.adapters.megatron import MegatronTrainer
from orchestrator.adapters.megatron_build import TinyGPTConfig, build_gpt, device, init_process_group, train_step
from orchestrator.adapters.storage import StorageRegions
from orchestrator.regions import RegionLedger
from states import Mode, Region

AWKWARD = {"num_experts": 2, "fp32_param": True, "frozen_param": True}
PRESETS = {
    "cpu": TinyGPTConfig(hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=4,
                         ffn_hidden_size=1536, vocab_size=8192, **AWKWARD),
    # about 1.1 G params: the size the GPU goals are stated at
    "gpu-1b": TinyGPTConfig(hidden_size=2048, num_layers=16, num_attention_heads=16, num_query_groups=8,
                            ffn_hidden_size=7168, vocab_size=32768, seq_len=128, **AWKWARD),
}  # fmt: skip


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `fn`, synchronised on the device."""
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def free_memory() -> int:
    if torch.cuda.is_available():
        sync()
        return torch.cuda.mem_get_info()[0]
    import psutil

    return -psutil.Process().memory_info().rss  # less RSS is more free


def cycle(
    trainer: MegatronTrainer, ledger: RegionLedger, mode: Mode, freed: dict[str, dict[str, int]]
) -> tuple[float, bool]:
    """pause_grads → drop_params → restore, as the lifecycle runs them; returns (restore s, identical).

    `freed` gets, per pause, the bytes the regions counted as freed (`colocate.bytes_freed`) and
    the memory measured handed back: device memory on a GPU, RSS on the CPU. On the CPU
    `default`'s backup lives in the same RAM, so its pause counts 0 and RSS may even grow.
    """
    before = dict(trainer.digests())
    trainer.stash(mode)
    for tag in (Region.GRAD_BUFFER, Region.DEFAULT, Region.PARAM_BUFFER):
        start = free_memory()
        counted = ledger.pause(tag)
        freed[tag.value] = {"counted": counted, "measured": free_memory() - start}
    for tag in (Region.DEFAULT, Region.GRAD_BUFFER, Region.PARAM_BUFFER):
        ledger.resume(tag)
    sync()
    start = time.perf_counter()
    trainer.rebuild(mode)  # synchronises before returning
    seconds = time.perf_counter() - start
    return seconds, restore_bit_identical(before, trainer.digests()).ok


def regions_for(trainer: MegatronTrainer) -> Any:
    if torch.cuda.is_available():
        from orchestrator.adapters.tms import TorchMemorySaverRegions

        return TorchMemorySaverRegions(trainer.region_tensors)
    return StorageRegions(trainer.region_tensors)


def breakdown(trainer: MegatronTrainer, repeats: int) -> dict[str, float]:
    """Each step of a rematerialize restore, and the copy roofline for the cast.

    The cast reads 4 B and writes 2 B a param; a bf16 copy of the same params reads and writes
    2 B each. Both casts are timed: Megatron's own loop and the fused one.
    """
    params = trainer.layout().param_bytes // 2
    times = {
        "cast_s": timed(trainer.cast_mains, repeats),
        "gather_s": timed(trainer.gather_params, repeats),
        "extras_s": timed(trainer.copy_extras_back, repeats),
    }
    src = torch.empty(params, dtype=torch.bfloat16, device=device())
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), repeats)
    cast_bw, copy_bw = 6 * params / times["cast_s"], 4 * params / copy_s
    return times | {"cast_GBps": cast_bw / 1e9, "copy_GBps": copy_bw / 1e9, "cast_vs_copy": cast_bw / copy_bw}


def run(cfg: TinyGPTConfig, repeats: int) -> dict[str, Any]:
    init_process_group(
        0, 1, int(os.environ.get("MASTER_PORT", "29533")), "nccl" if torch.cuda.is_available() else "gloo"
    )
    chunks, optimizer = build_gpt(cfg)
    train_step(chunks, optimizer, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1)))  # creates Adam state
    digest = DigestMethod.DEVICE if torch.cuda.is_available() else DigestMethod.SHA256
    trainer = MegatronTrainer(chunks, optimizer, digest=digest)
    ledger = RegionLedger(regions_for(trainer))
    params = sum(p.numel() for p in trainer._params.values())
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "params": params,
    }
    identical: list[bool] = []
    freed: dict[str, dict[str, int]] = {}  # kept from the first cycle, when every page was touched by training
    for mode in (Mode.REMATERIALIZE, Mode.BACKUP):  # remat first: its pinned bytes exclude backup's copy
        runs = [cycle(trainer, ledger, mode, freed if not identical and i == 0 else {}) for i in range(repeats)]
        result[f"{'remat' if mode is Mode.REMATERIALIZE else 'backup'}_restore_s"] = statistics.median(
            s for s, _ in runs
        )
        result[f"host_pinned_bytes_{'remat' if mode is Mode.REMATERIALIZE else 'backup'}"] = trainer.host_pinned_bytes()
        identical += [ok for _, ok in runs]
    result["speedup"] = result["backup_restore_s"] / result["remat_restore_s"]
    result["pinned_ratio"] = result["host_pinned_bytes_remat"] / result["host_pinned_bytes_backup"]
    result["bit_identical"] = all(identical)
    result["freed_bytes"] = freed
    result |= breakdown(trainer, repeats)
    return result


def show(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"restore of {result['params'] / 1e6:.1f} M params on {result['device']}")
    table.add_column("")
    table.add_column("rematerialize", justify="right")
    table.add_column("backup", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row(
        "restore seconds",
        f"{result['remat_restore_s']:.4f}",
        f"{result['backup_restore_s']:.4f}",
        f"speedup {result['speedup']:.2f}x",
    )
    table.add_row(
        "pinned host bytes",
        f"{result['host_pinned_bytes_remat']:,}",
        f"{result['host_pinned_bytes_backup']:,}",
        f"{result['pinned_ratio']:.2e}",
    )
    Console().print(table)
    print(f"bit-identical restores: {result['bit_identical']}")
    steps = ", ".join(
        f"{k[:-2]} {v * 1e3:.2f} ms" for k, v in result.items() if k.endswith("_s") and "restore" not in k
    )
    print(f"restore steps: {steps}")
    print(
        f"cast {result['cast_GBps']:.1f} GB/s vs copy {result['copy_GBps']:.1f} GB/s: {result['cast_vs_copy']:.0%} of the copy roofline"
    )
    what = "device memory" if torch.cuda.is_available() else "RSS"
    freed = ", ".join(
        f"{tag} {v['counted'] / 2**20:.1f} / {v['measured'] / 2**20:.1f} MiB"
        for tag, v in result["freed_bytes"].items()
    )
    print(f"freed at each pause, counted (colocate.bytes_freed) / measured ({what}): {freed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu-1b" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--repeats", type=int, default=5, help="restore cycles per mode; medians are shown")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = parser.parse_args()
    cfg = PRESETS[args.preset] if args.layers is None else replace(PRESETS[args.preset], num_layers=args.layers)
    result = run(cfg, args.repeats)
    print(json.dumps(result)) if args.json else show(result)


if __name__ == "__main__":
    main()
