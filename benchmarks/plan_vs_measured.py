"""The memory plan next to what a real Megatron-core model takes, region by region and phase by phase.

Each data-parallel rank builds the preset (megatron-core DDP + DistributedOptimizer, Adam), trains
one step, puts its buffers in memory regions (torch_memory_saver on a GPU) and runs the
lifecycle's pause/restore order once per mode. It records the bytes of every buffer and, on a
GPU, what the driver says each pause frees and what each phase holds above the bare process.
`colocate plan` predicts the same rows without building anything.

    python benchmarks/plan_vs_measured.py --measure --dp 1 2 --out measured.json   # build, measure
    python benchmarks/plan_vs_measured.py --measured measured.json                 # print side by side
    python benchmarks/plan_vs_measured.py --timing benchmarks/step_llama-1b.always.h200.json  # seconds

`--timing` compares the time model's seconds per phase with what `step_overhead.py` recorded
(`benchmarks/timing_vs_measured.py`), without building anything.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.plan.memory import Parallelism, Plan, plan
from orchestrator.plan.presets import GPTS
from states import Mode, Offload

LIMIT = 0.05


def planned(preset: str, dp: int, ep: int = 1) -> Plan:
    # The measurement pauses every region, so the plan it is checked against moves every one.
    return plan(GPTS[preset], Parallelism(dp=dp, ep=ep), offload=Offload.ALWAYS)


# ---- measuring (imports torch and megatron-core) ----------------------------------------


def _built(preset: str) -> TinyGPTConfig:
    """The job's config of the planner's GPT `preset`: `cpu` and `gpu-1b` are the restore
    benchmark's `cpu` and `llama-1b`, the others the presets of their names."""
    from orchestrator.job.presets import benchmark_model
    from orchestrator.job.presets import preset as job_preset

    if preset == "cpu":
        return benchmark_model("cpu")
    if preset == "gpu-1b":
        return benchmark_model("llama-1b")
    return job_preset(preset)


def _used() -> int:
    """Device bytes in use by the driver's count, less the caching allocator's free blocks.

    No `empty_cache()`: with torch_memory_saver's hooks in place it exits the process.
    """
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return int(total - free - cached)


def _rank(rank: int, world: int, port: int, preset: str, out: str, ep: int) -> None:
    import torch

    from orchestrator.adapters.megatron.build import build_gpt, init_process_group, train_step

    cuda = torch.cuda.is_available()
    init_process_group(rank, world, port, "nccl" if cuda else "gloo", expert_model_parallel_size=ep)
    # NCCL's communicator and cuBLAS's workspace are the process's, not the model's: warm both.
    warm = torch.ones(1024, 1024, device="cuda" if cuda else "cpu")
    torch.distributed.all_reduce(warm)
    warm @ warm
    del warm
    base = _used() if cuda else 0
    cfg = _built(preset)
    chunks, optimizer = build_gpt(cfg)
    train_step(chunks, optimizer, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1)))
    print(f"rank {rank}: built and trained one step", file=sys.stderr, flush=True)
    result = _measure(chunks, optimizer, base, preset, ep)
    result |= {"rank": rank, "world": world, "preset": preset}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank}: measured", file=sys.stderr, flush=True)
    if cuda:  # torch_memory_saver exits the process when teardown frees its regions' tensors
        os._exit(0)
    torch.distributed.destroy_process_group()


def _measure(chunks: Any, optimizer: Any, base: int, preset: str, ep: int) -> dict[str, Any]:
    import torch

    from guards.bitexact import restore_bit_identical
    from orchestrator.adapters.megatron.trainer import MegatronTrainer
    from orchestrator.adapters.transport.bucketed import nbytes
    from orchestrator.core.regions import RegionLedger
    from states import Region

    cuda = torch.cuda.is_available()
    trainer = MegatronTrainer(chunks, optimizer)  # digests on the device on a GPU
    tensors = trainer.region_tensors()
    frozen = sum(nbytes(p) for p in trainer._params.values() if not p.requires_grad)
    mains = sum(nbytes(t) for o in trainer._optimizers for g in o.shard_fp32_from_float16_groups for t in g)
    m: dict[str, Any] = {
        "param_buffer": sum(nbytes(t) for t in tensors["param_buffer"]),
        "grad_buffer": sum(nbytes(t) for t in tensors["grad_buffer"]),
        "mains": mains,
        "adam": sum(nbytes(t) for t in tensors["default"]) - mains,
        "extras": trainer.layout().extras_bytes,
        "frozen": frozen,
    }
    if cuda:
        from orchestrator.adapters.regions.tms import TorchMemorySaverRegions

        regions: Any = TorchMemorySaverRegions(trainer.region_tensors)
    else:
        from orchestrator.adapters.regions.storage import StorageRegions

        regions = StorageRegions(trainer.region_tensors)
    ledger = RegionLedger(regions)
    print("regions in place", file=sys.stderr, flush=True)
    device: dict[str, int] = {}
    freed: dict[str, int] = {}
    for mode in (Mode.REMATERIALIZE, Mode.BACKUP):
        before = dict(trainer.digests())
        if cuda and mode is Mode.REMATERIALIZE:
            device["train"] = _used() - base
        trainer.stash(mode)
        m[f"pinned_{mode.value}"] = trainer.host_pinned_bytes()
        for tag in (Region.GRAD_BUFFER, Region.DEFAULT, Region.PARAM_BUFFER):
            got = ledger.pause(tag)
            if mode is Mode.REMATERIALIZE:
                freed[tag.value] = got
                if cuda and tag is Region.DEFAULT:
                    device["grads_paused"] = _used() - base
        if cuda and mode is Mode.REMATERIALIZE:
            device["params_dropped"] = _used() - base
            m["residue"] = _residue()
        for tag in (Region.DEFAULT, Region.GRAD_BUFFER, Region.PARAM_BUFFER):
            ledger.resume(tag)
        trainer.rebuild(mode)
        if cuda and mode is Mode.REMATERIALIZE:
            device["restore"] = _used() - base
        m[f"identical_{mode.value}"] = restore_bit_identical(before, trainer.digests()).ok
        print(f"{mode} cycle done", file=sys.stderr, flush=True)
    m["freed"] = freed if cuda else {}
    m["device"] = device
    if cuda:
        try:
            m["refusal"] = _refuse_on_gpu(trainer, ledger, preset, ep)
        except Exception as exc:  # the measurements above stand without it
            m["refusal"] = {"error": f"{type(exc).__name__}: {exc}"}
    return m


def _residue() -> dict[str, Any]:
    """What holds device memory once every region is paused: live CUDA tensors, largest first."""
    import gc

    import torch

    seen: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = (storage.nbytes(), f"{tuple(obj.shape)} {obj.dtype}")
        except Exception:  # some objects refuse isinstance or storage access
            continue
    top = sorted(seen.values(), reverse=True)[:12]
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "live_tensor_bytes": sum(n for n, _ in seen.values()),
        "largest": top,
    }


def _refuse_on_gpu(trainer: Any, ledger: Any, preset: str, ep: int) -> dict[str, Any]:
    """Drop everything, fill the GPU so the restore cannot fit, and ask the memory guard.

    The guard reads `torch.cuda.mem_get_info` through the plan's probe; it must refuse with the
    bytes needed and free, and nothing may be allocated by asking. Then the filler goes, the
    guard admits, and the restore runs.
    """
    import torch

    from guards.memory import memory_fits
    from orchestrator.plan.budget import MemoryProbe
    from states import Phase, Region, Snapshot, TrainerLayout

    world = torch.distributed.get_world_size()
    probe = MemoryProbe.for_plan(planned(preset, world, ep), host_free=2**62)
    trainer.stash(Mode.REMATERIALIZE)
    for tag in (Region.GRAD_BUFFER, Region.DEFAULT, Region.PARAM_BUFFER):
        ledger.pause(tag)

    def snap() -> Snapshot:
        return Snapshot(
            phase=Phase.ROLLOUT, mode=Mode.REMATERIALIZE, step=1, paused=ledger.paused, engine_attached=True,
            engine_resident=frozenset(), engine_idle=True, engine_synced=True, engine_version=1,
            weight_version=1, cache_flushed=True, trained_since_sync=False, extras_stashed=True, params_valid=False,
            layout=TrainerLayout(), memory=probe(),
        )  # fmt: skip

    need = sum(probe.regions.values())
    free = torch.cuda.mem_get_info()[0]
    # Another tenant's memory, taken with cudaMalloc outside torch's cache so that freeing it
    # really gives it back (empty_cache() exits the process under torch_memory_saver's hooks).
    from cupy.cuda import runtime

    filler = runtime.malloc(free - need // 2)
    free_before = torch.cuda.mem_get_info()[0]
    refused = memory_fits(snap())
    free_after = torch.cuda.mem_get_info()[0]
    runtime.free(filler)
    admitted = memory_fits(snap())
    for tag in (Region.DEFAULT, Region.GRAD_BUFFER, Region.PARAM_BUFFER):
        ledger.resume(tag)
    trainer.rebuild(Mode.REMATERIALIZE)
    return {
        "refused_ok": refused.ok,
        "reason": refused.reason,
        "free_before": free_before,
        "free_after": free_after,
        "admitted_ok": admitted.ok,
    }


def measure(preset: str, dps: list[int], ep: int = 1, start_method: str = "spawn") -> dict[str, Any]:
    """Build `preset` at each data-parallel size (experts split `ep` ways), one process a rank,
    started by `start_method` (the tests pass their fork server's, tests/support/spawn.py)."""
    import torch.multiprocessing as mp

    runs: dict[str, Any] = {}
    for dp in dps:
        with tempfile.TemporaryDirectory() as out:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_rank, args=(dp, port, preset, out, ep), nprocs=dp, start_method=start_method)
            runs[str(dp)] = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(dp)]
            print(f"measured {preset} at DP={dp}", file=sys.stderr)
    return {"preset": preset, "ep": ep, "runs": runs}


# ---- showing -------------------------------------------------------------------------------


def rows(p: Plan, got: dict[str, Any]) -> list[tuple[str, int, int]]:
    r = p.ranks[0]
    out = [
        ("bf16 + fp32 param buffers", r.param_buffer, got["param_buffer"]),
        ("grad buffers (fp32)", r.grad_buffer, got["grad_buffer"]),
        ("fp32 mains", r.mains, got["mains"]),
        ("Adam moments", r.adam, got["adam"]),
        ("extras (pinned, rematerialize)", r.extras, got["pinned_rematerialize"]),
        ("pinned backup (backup mode)", r.backup, got["pinned_backup"]),
    ]
    freed = got.get("freed") or {}
    if freed:
        out += [
            ("freed by pausing param_buffer", r.param_buffer, freed["param_buffer"]),
            ("freed by pausing grad_buffer", r.grad_buffer, freed["grad_buffer"]),
            ("freed by pausing default (mains + Adam)", r.optimizer_state, freed["default"]),
        ]
    phases = p.phases(r, engine=False)
    device = got.get("device") or {}
    for name, used in device.items():
        out.append((f"trainer device at {name}, above the bare process", phases[name][0], used))
    if device:  # what stays outside the regions in every phase, so the plan counts none of it
        residue = device["params_dropped"] - phases["params_dropped"][0]
        for name, used in device.items():
            if name != "params_dropped":  # there the residue is measured: nothing left to compare
                out.append((f"trainer device at {name}, less the residue", phases[name][0], used - residue))
    return out


def show(measured: dict[str, Any]) -> bool:
    from rich.console import Console
    from rich.table import Table

    console, ok = Console(width=130), True
    for dp, ranks in measured["runs"].items():
        p = planned(measured["preset"], int(dp), measured.get("ep", 1))
        for got in ranks:
            title = f"{measured['preset']} at DP={dp}, EP={measured.get('ep', 1)}, rank {got['rank']}"
            table = Table(title=f"{title}: plan vs measured (bytes)")
            for col in ("row", "plan", "measured", "measured / plan", "within 5%"):
                table.add_column(col, justify="left" if col == "row" else "right")
            for name, want, have in rows(p, got):
                ratio = have / want if want else float("inf") if have else 1.0
                good = abs(ratio - 1) <= LIMIT
                ok &= good
                table.add_row(name, f"{want:,}", f"{have:,}", f"{ratio:.4f}", "yes" if good else "[red]no[/]")
            console.print(table)
            device, residue = got.get("device") or {}, got.get("residue")
            if device and residue:
                outside = residue["allocated"] - p.ranks[0].trainer_state
                console.print(
                    f"residue: {device['params_dropped']:,} bytes stay in use with every region paused; "
                    f"torch's allocator holds {outside:,} of them outside the regions, the rest is the "
                    "driver's (CUDA context and lazily loaded kernels, NCCL communicators), not tensors"
                )
            refusal = got.get("refusal")
            if refusal and "error" in refusal:
                console.print(f"GPU refusal not run: {refusal['error']}")
            elif refusal:
                console.print(
                    f"GPU refusal: admitted={refusal['refused_ok']}, memory_fits: {refusal['reason']}; free before "
                    f"{refusal['free_before']:,}, after {refusal['free_after']:,}; admitted once freed: "
                    f"{refusal['admitted_ok']}"
                )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(GPTS), default="gpu-1b")
    parser.add_argument("--measure", action="store_true", help="build and measure here (GPU: torch_memory_saver)")
    parser.add_argument("--dp", type=int, nargs="+", default=[1], help="data-parallel sizes to measure")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides every DP size)")
    parser.add_argument("--out", type=Path, help="write the measurements here as JSON")
    parser.add_argument("--measured", type=Path, help="show these measurements instead of measuring")
    parser.add_argument(
        "--timing",
        type=Path,
        nargs="+",
        help="step_overhead.py (or families) JSON: the time model's seconds against them",
    )
    args = parser.parse_args()
    if args.timing:
        from benchmarks import timing_vs_measured

        timing_vs_measured.main([str(p) for p in args.timing] + (["--out", str(args.out)] if args.out else []))
        return
    if args.measured is not None:
        measured = json.loads(args.measured.read_text())
    elif args.measure:
        measured = measure(args.preset, args.dp, args.ep)
        if args.out is not None:
            args.out.write_text(json.dumps(measured, indent=1))
    else:
        parser.error("give --measure (build and measure) or --measured FILE")
    show(measured)


if __name__ == "__main__":
    main()
