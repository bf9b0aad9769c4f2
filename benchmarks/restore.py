"""Restore a dropped bf16 param buffer both ways, side by side, on 1 or N data-parallel ranks.

- rematerialize: cast the fp32 mains to bf16 and all-gather; copy a few KB of extras back;
- backup: copy the pinned host copy of every bf16 param back (today's stacks).

The model is a preset of `orchestrator.job.presets` (Llama-shaped megatron-core GPT) with an MoE
layer (expert_bias), an fp32 param and a frozen param, in DDP + DistributedOptimizer. With
`--ranks N` it runs N processes at DP = N (one GPU each, NCCL; gloo on the CPU). On a GPU the
regions are torch_memory_saver's and a device-to-device copy of the same bytes is timed as the
roofline for the cast. Per rank it times the cast (the Triton kernel of `fast_cast` and
Megatron's own loop), Megatron's NCCL param all-gather, the extras, both whole restores, and at
DP > 1 the pipelined restore whose cast overlaps the exchange.

    python benchmarks/restore.py [--preset cpu|tiny|qwen-0.5b|llama-1b] [--ranks N] [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
import torch.multiprocessing as mp

from guards.bitexact import restore_bit_identical
from orchestrator.adapters.megatron.build import (
    TinyGPTConfig,
    build_gpt,
    destroy_process_group,
    device,
    init_process_group,
    train_step,
)
from orchestrator.adapters.megatron.fast_cast import MainParamCast, PipelinedRestore
from orchestrator.adapters.megatron.trainer import MegatronTrainer
from orchestrator.adapters.regions.storage import StorageRegions
from orchestrator.core.regions import RegionLedger
from orchestrator.job.presets import BENCHMARK_MODELS, benchmark_model
from states import Mode, Region


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def barrier() -> None:
    sync()
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `fn`, synchronised on the device; ranks start each repeat together."""
    times = []
    for _ in range(repeats):
        barrier()
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
    trainer: MegatronTrainer,
    ledger: RegionLedger,
    mode: Mode,
    freed: dict[str, dict[str, int]],
    rebuild: Callable[[], object],
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
    barrier()
    start = time.perf_counter()
    rebuild()
    sync()
    seconds = time.perf_counter() - start
    return seconds, restore_bit_identical(before, trainer.digests()).ok


def regions_for(trainer: MegatronTrainer) -> Any:
    if torch.cuda.is_available():
        from orchestrator.adapters.regions.tms import TorchMemorySaverRegions

        return TorchMemorySaverRegions(trainer.region_tensors)
    return StorageRegions(trainer.region_tensors)


def breakdown(trainer: MegatronTrainer, repeats: int) -> dict[str, float]:
    """Each step of a rematerialize restore, and the copy roofline for the cast.

    The cast reads 4 B and writes 2 B a param of this rank's shard; a bf16 copy of the same
    params reads and writes 2 B each. Both casts are timed: `fast_cast`'s and Megatron's loop.
    """
    megatron = MainParamCast(trainer._optimizers, use_kernel=False)
    shard = sum(src.numel() for src, _ in megatron.pairs)
    times = {
        "cast_s": timed(trainer.cast_mains, repeats),
        "cast_megatron_s": timed(megatron, repeats),
        "gather_s": timed(trainer.gather_params, repeats),
        "extras_s": timed(trainer.copy_extras_back, repeats),
    }
    src = torch.empty(shard, dtype=torch.bfloat16, device=device())
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), repeats)
    cast_bw, copy_bw = 6 * shard / times["cast_s"], 4 * shard / copy_s
    return times | {
        "cast_path": trainer.cast.path,  # type: ignore[dict-item]
        "cast_unavailable": trainer.cast.unavailable,  # type: ignore[dict-item]
        "shard_params": shard,
        "copy_s": copy_s,
        "cast_GBps": cast_bw / 1e9,
        "copy_GBps": copy_bw / 1e9,
        "cast_vs_copy": cast_bw / copy_bw,
    }


def overlapped(trainer: MegatronTrainer, pipelined: PipelinedRestore) -> Callable[[], None]:
    """A whole rematerialize restore with the cast overlapping the exchange, then the extras."""

    def restore() -> None:
        pipelined()
        trainer.copy_extras_back()

    return restore


def digest_of(digests: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()


def run(rank: int, world_size: int, port: int, cfg: TinyGPTConfig, repeats: int) -> dict[str, Any]:
    """One rank's side-by-side; every rank of the group runs it."""
    init_process_group(rank, world_size, port, "nccl" if torch.cuda.is_available() else "gloo")
    chunks, optimizer = build_gpt(cfg)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data shard
    train_step(chunks, optimizer, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=generator))
    trainer = MegatronTrainer(chunks, optimizer)  # digests on the device on a GPU
    ledger = RegionLedger(regions_for(trainer))
    result: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "params": sum(p.numel() for p in trainer._params.values()),
    }
    restores: dict[str, Callable[[], object]] = {
        "remat": lambda: trainer.rebuild(Mode.REMATERIALIZE),
        "backup": lambda: trainer.rebuild(Mode.BACKUP),
    }
    if world_size > 1 and trainer.cast.path == "triton":
        variants = {  # how the pieces travel, and how large they are
            "pipelined": {"exchange": "p2p", "piece_bytes": 128 << 20},
            "pipelined_broadcast": {"exchange": "broadcast", "piece_bytes": 128 << 20},
            "pipelined_broadcast_512MiB": {"exchange": "broadcast", "piece_bytes": 512 << 20},
        }
        for label, kwargs in variants.items():
            restores[label] = overlapped(trainer, PipelinedRestore(chunks, trainer.cast, **kwargs))  # type: ignore[arg-type]
        restores["backup"] = restores.pop("backup")  # last: the others' pinned bytes exclude its copy
    identical: dict[str, bool] = {}
    freed: dict[str, dict[str, int]] = {}  # kept from the first cycle, when every page was touched by training
    for name, rebuild in restores.items():
        mode = Mode.BACKUP if name == "backup" else Mode.REMATERIALIZE
        runs = [
            cycle(trainer, ledger, mode, freed if not identical and i == 0 else {}, rebuild) for i in range(repeats)
        ]
        result[f"{name}_restore_s"] = statistics.median(s for s, _ in runs)
        result[f"host_pinned_bytes_{name}"] = trainer.host_pinned_bytes()
        identical[name] = all(ok for _, ok in runs)
    result["speedup"] = result["backup_restore_s"] / result["remat_restore_s"]
    for name in restores:
        if name.startswith("pipelined"):
            result[f"speedup_{name}"] = result["backup_restore_s"] / result[f"{name}_restore_s"]
    result["pinned_ratio"] = result["host_pinned_bytes_remat"] / result["host_pinned_bytes_backup"]
    result["bit_identical"] = identical
    result["params_digest"] = digest_of(dict(trainer.digests()))
    result["freed_bytes"] = freed
    result |= breakdown(trainer, repeats)
    destroy_process_group()
    return result


def _rank_main(rank: int, world_size: int, port: int, cfg: TinyGPTConfig, repeats: int, results: Any) -> None:
    try:
        results.put(run(rank, world_size, port, cfg, repeats))
    except BaseException as error:
        import traceback

        results.put({"rank": rank, "error": f"{error!r}\n{traceback.format_exc()}"})
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(Exception):
    """The rendezvous port was taken between choosing it and binding it."""


def run_ranks(cfg: TinyGPTConfig, ranks: int, repeats: int, timeout: float = 1800) -> list[dict[str, Any]]:
    """`run` on `ranks` spawned processes (one GPU each where there are GPUs); results by rank.

    A rank that fails ends the run with its traceback; one that hangs, after `timeout` seconds.
    A free port chosen here can be taken by another program before rank 0 binds it: then the
    ranks start again on another (three tries), unless MASTER_PORT names the port."""
    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        raise SystemExit(f"--ranks {ranks} needs {ranks} GPUs; {torch.cuda.device_count()} visible")
    fixed = os.environ.get("MASTER_PORT")
    for attempt in range(1 if fixed else 3):
        try:
            return _attempt(cfg, ranks, repeats, timeout, int(fixed) if fixed else free_port())
        except PortTaken:
            if fixed or attempt == 2:
                raise SystemExit("the rendezvous port was in use; set MASTER_PORT to a free one") from None
    raise AssertionError("unreachable")


def _attempt(cfg: TinyGPTConfig, ranks: int, repeats: int, timeout: float, port: int) -> list[dict[str, Any]]:
    # One process per rank at DP=1 too: run in this process, the benchmark exited with status 1
    # after printing its results (twice on an H200, under torch_memory_saver; cause not found).
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, cfg, repeats, results)) for r in range(ranks)]
    for p in procs:
        p.start()
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < ranks:
            try:
                out.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
            except Exception as error:
                raise SystemExit(f"{ranks - len(out)} rank(s) gave no result within {timeout:.0f} s") from error
            if "error" in out[-1]:
                if "EADDRINUSE" in out[-1]["error"]:
                    raise PortTaken
                raise SystemExit(f"rank {out[-1]['rank']} failed:\n{out[-1]['error']}")
    finally:
        if len(out) < ranks or any("error" in r for r in out):
            for p in procs:
                p.kill()
    for p in procs:
        p.join(60)
    return sorted(out, key=lambda r: r["rank"])


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What holds across ranks: every restore bit-identical, and every rank the same params."""
    return {
        "ranks": len(results),
        "bit_identical_all_ranks": all(all(r["bit_identical"].values()) for r in results),
        "same_params_all_ranks": len({r["params_digest"] for r in results}) == 1,
        "worst_speedup": min(r["speedup"] for r in results),
        **{f"worst_{key}": min(r[key] for r in results) for key in results[0] if key.startswith("speedup_pipelined")},
    }


def show(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    first = results[0]
    table = Table(title=f"restore of {first['params'] / 1e6:.1f} M params at DP={len(results)} on {first['device']}")
    table.add_column("rank")
    table.add_column("cast ms", justify="right")
    table.add_column("Megatron cast ms", justify="right")
    table.add_column("cast vs copy", justify="right")
    table.add_column("all-gather ms", justify="right")
    table.add_column("extras ms", justify="right")
    table.add_column("remat ms", justify="right")
    table.add_column("pipelined ms", justify="right")
    table.add_column("backup ms", justify="right")
    table.add_column("speedup", justify="right")
    for r in results:
        pipelined = r.get("pipelined_restore_s")
        table.add_row(
            str(r["rank"]),
            f"{r['cast_s'] * 1e3:.2f} ({r['cast_path']})",
            f"{r['cast_megatron_s'] * 1e3:.2f}",
            f"{r['cast_vs_copy']:.0%}",
            f"{r['gather_s'] * 1e3:.2f}",
            f"{r['extras_s'] * 1e3:.2f}",
            f"{r['remat_restore_s'] * 1e3:.2f}",
            "-" if pipelined is None else f"{pipelined * 1e3:.2f}",
            f"{r['backup_restore_s'] * 1e3:.2f}",
            f"{r['speedup']:.1f}x" + ("" if pipelined is None else f" / {r['speedup_pipelined']:.1f}x pipelined"),
        )
    Console().print(table)
    total = summary(results)
    print(f"bit-identical restores on every rank: {total['bit_identical_all_ranks']}; "
          f"same params on every rank: {total['same_params_all_ranks']}")  # fmt: skip
    print(f"pinned host bytes per rank: rematerialize {first['host_pinned_bytes_remat']:,}, backup {first['host_pinned_bytes_backup']:,}")  # fmt: skip
    what = "device memory" if torch.cuda.is_available() else "RSS"
    for r in results:
        freed = ", ".join(
            f"{tag} {v['counted'] / 2**20:.1f} / {v['measured'] / 2**20:.1f} MiB" for tag, v in r["freed_bytes"].items()
        )
        print(f"rank {r['rank']}: freed at each pause, counted (colocate.bytes_freed) / measured ({what}): {freed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", choices=BENCHMARK_MODELS, default="llama-1b" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel ranks, one process (and GPU) each")
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--repeats", type=int, default=5, help="restore cycles per mode; medians are shown")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    cfg = (
        benchmark_model(args.preset)
        if args.layers is None
        else replace(benchmark_model(args.preset), num_layers=args.layers)
    )
    results = run_ranks(cfg, args.ranks, args.repeats)
    if args.json:
        print(json.dumps({"summary": summary(results), "ranks": results}))
    else:
        show(results)


if __name__ == "__main__":
    main()
