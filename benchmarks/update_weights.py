"""update_weights by CUDA IPC: a rank pushes its weights, in buckets, into an engine on its GPU.

The rank is a megatron-core GPT (a preset of `orchestrator.job.presets`, dense) in DDP +
DistributedOptimizer; the engine replica is `TransformersEngine` in a process of its own on
the same GPU, as colocated stacks place SGLang. The rank converts its resident params to HF
names (`convert.to_hf`: views of the param buffer; q/k/v are copies, kept in staging tensors)
and pushes them bucket by bucket; the engine copies each bucket into its params
(`update_weights`) and acknowledges it, at most `--window` buckets being in flight.

Two ways of handing the tensors over, both torch's CUDA IPC (`torch.multiprocessing`):

- `per-bucket`: every bucket's tensors are pickled into the queue (an IPC handle each);
- `registered`: the tensors are shared once; a bucket is then a list of names. The rank's
  param buffers keep their addresses (torch_memory_saver resumes at the same ones), so the
  engine reads the current bytes each time.
- `staged`: what `colocate run --device cuda --ranks N` does. Legacy CUDA IPC cannot share
  torch_memory_saver's memory (cuMemCreate), so the rank packs each bucket into one of two
  plain staging buffers (shared once) and the engine loads from it while the rank packs the
  next: every byte is copied twice, so half the copy's rate is this mode's ceiling.

The engine loads a bucket with one multi-tensor copy (`torch._foreach_copy_`).

Against a device-to-device copy of the same bytes on the same GPU, for several bucket sizes.

    python benchmarks/update_weights.py [--preset llama-1b] [--buckets-mib 16 64 256 1024 4096] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
import torch.multiprocessing as mp

from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.adapters.transport.bucketed import buckets, nbytes
from orchestrator.job.presets import PRESETS, preset
from orchestrator.job.workers.staging import ALIGN, Slot, StagingBuffer

MODES = ("per-bucket", "registered", "staged")


def _engine_main(cfg: TinyGPTConfig, inbox: Any, outbox: Any) -> None:
    """The engine replica: serve update_weights messages until told to stop."""
    from orchestrator.adapters.digest import device_digests
    from orchestrator.adapters.engines.transformers import TransformersEngine
    from orchestrator.job.workers.staging import attach

    try:
        engine = TransformersEngine(cfg, max_batch=1, max_len=cfg.seq_len, device="cuda:0")
        sources: dict[str, torch.Tensor] = {}
        outbox.put(("ready", sum(nbytes(p) for p in engine.model.parameters())))
        while True:
            kind, *body = inbox.get()
            if kind == "stop":
                return
            if kind == "attach":
                (handles,) = body
                buffers = [attach(h) for h in handles]
                outbox.put(("attached", len(buffers)))
            elif kind == "staged":
                index, slots, version = body
                written = engine.update_weights([(s.name, s.view(buffers[index])) for s in slots], version)
                torch.cuda.current_stream().synchronize()
                outbox.put(("done", written))
            elif kind == "register":
                (named,) = body
                sources.update(named)
                outbox.put(("registered", len(sources)))
            elif kind == "bucket":
                named, version = body
                if named and isinstance(named[0], str):  # registered: names only
                    named = [(name, sources[name]) for name in named]
                written = engine.update_weights(named, version)
                torch.cuda.current_stream().synchronize()
                outbox.put(("done", written))
            elif kind == "digests":
                outbox.put(("digests", device_digests(dict(engine.model.named_parameters()))))
    except BaseException as error:
        import traceback

        outbox.put(("error", f"{error!r}\n{traceback.format_exc()}"))


class Replica:
    """The rank's handle on the engine process."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_engine_main, args=(cfg, self.inbox, self.outbox), daemon=True)
        self.process.start()

    def expect(self, kind: str, timeout: float = 600) -> Any:
        got, *body = self.outbox.get(timeout=timeout)
        if got == "error":
            raise RuntimeError(f"engine process failed:\n{body[0]}")
        if got != kind:
            raise RuntimeError(f"engine answered {got!r}, expected {kind!r}")
        return body[0]

    def stop(self) -> None:
        self.inbox.put(("stop",))
        self.process.join(60)


class Staged:
    """The rank's converted tensors, converted once: views of the param buffers where `to_hf`
    gives views, else persistent staging tensors (allocated once, so their IPC handles stay
    valid) that `refresh` fills again from the tensors they came from."""

    def __init__(self, trainer: Any, cfg: TinyGPTConfig) -> None:
        from orchestrator.adapters.megatron.convert import to_hf

        self.cfg = cfg
        buffers = {b.param_data.untyped_storage().data_ptr() for b in trainer._buffers}
        self.named: list[tuple[str, torch.Tensor]] = []
        self._copied: list[tuple[str, torch.Tensor, list[torch.Tensor]]] = []  # (megatron name, source, staging)
        for name, tensor in trainer.sync_tensors():
            converted = to_hf(name, tensor, cfg)
            staging = []
            for hf_name, part in converted:
                if part.untyped_storage().data_ptr() not in buffers:
                    part = part.clone()
                    staging.append(part)
                self.named.append((hf_name, part))
            if staging:
                self._copied.append((name, tensor, staging))

    def refresh(self) -> list[tuple[str, torch.Tensor]]:
        """Re-convert the tensors that conversion copies (q, k, v), into their staging tensors."""
        from orchestrator.adapters.megatron.convert import to_hf

        for name, tensor, staging in self._copied:
            fresh = [
                part
                for _, part in to_hf(name, tensor, self.cfg)
                if part.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
            ]
            for target, part in zip(staging, fresh, strict=True):
                target.copy_(part)
        return self.named


def push(replica: Replica, staged: Staged, mode: str, bucket_bytes: int, version: int, window: int) -> int:
    """One whole sync; returns the bytes the engine wrote."""
    named = staged.refresh()
    torch.cuda.current_stream().synchronize()  # staging copies done before the engine reads them
    written = in_flight = 0
    for bucket in buckets(named, bucket_bytes):
        payload = [name for name, _ in bucket] if mode == "registered" else bucket
        replica.inbox.put(("bucket", payload, version))
        in_flight += 1
        if in_flight == window:
            written += replica.expect("done")
            in_flight -= 1
    for _ in range(in_flight):
        written += replica.expect("done")
    return int(written)


def staged_plan(named: list[tuple[str, torch.Tensor]], capacity: int) -> list[list[tuple[Slot, torch.Tensor]]]:
    """The tensors in buckets that each fit a staging buffer of `capacity` bytes, with their slots."""
    plan: list[list[tuple[Slot, torch.Tensor]]] = [[]]
    offset = 0
    for name, tensor in named:
        size = nbytes(tensor)
        if plan[-1] and offset + size > capacity:
            plan.append([])
            offset = 0
        plan[-1].append((Slot(name, offset, tuple(tensor.shape), tensor.dtype), tensor))
        offset += -(-size // ALIGN) * ALIGN
    return plan


def push_staged(replica: Replica, staged: Staged, buffers: list[torch.Tensor], capacity: int, version: int) -> int:
    """One whole sync through the staging buffers: pack bucket i into buffer i % 2 while the
    engine loads bucket i - 1 from the other."""
    staged.refresh()
    written = 0
    plan = staged_plan(staged.named, capacity)
    for i, bucket in enumerate(plan):
        if i >= len(buffers):
            written += replica.expect("done")  # bucket i - 2 is loaded: its buffer is free
        buffer = buffers[i % len(buffers)]
        torch._foreach_copy_([slot.view(buffer) for slot, _ in bucket], [t for _, t in bucket])
        torch.cuda.current_stream().synchronize()
        replica.inbox.put(("staged", i % len(buffers), [slot for slot, _ in bucket], version))
    for _ in range(min(len(plan), len(buffers))):
        written += replica.expect("done")
    return written


def d2d_copy_s(total: int, repeats: int) -> float:
    src = torch.randn(total // 2, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run(cfg: TinyGPTConfig, bucket_mib: list[int], repeats: int, window: int) -> dict[str, Any]:
    from orchestrator.adapters.digest import device_digests
    from orchestrator.adapters.megatron.build import build_gpt, init_process_group, train_step
    from orchestrator.adapters.megatron.trainer import MegatronTrainer

    replica = Replica(cfg)  # starts while the rank builds
    init_process_group(0, 1, int(os.environ.get("MASTER_PORT", "29541")), "nccl")
    chunks, optimizer = build_gpt(cfg)
    train_step(chunks, optimizer, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1)))
    trainer = MegatronTrainer(chunks, optimizer)
    staged = Staged(trainer, cfg)
    total = sum(nbytes(t) for _, t in staged.named)
    largest = max(nbytes(t) for _, t in staged.named)
    engine_bytes = replica.expect("ready")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "params": sum(t.numel() for _, t in staged.named),
        "bytes": total,
        "engine_bytes": engine_bytes,
        "tensors": len(staged.named),
        "window": window,
    }
    copy_s = d2d_copy_s(total, repeats)
    refresh = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        staged.refresh()
        torch.cuda.synchronize()
        refresh.append(time.perf_counter() - start)
    result["refresh_s"] = statistics.median(refresh)  # the rank's conversion copies (q, k, v)
    result["copy_s"], result["copy_GBps"] = copy_s, total / copy_s / 1e9
    rows = []
    version = 0
    for mode in MODES:
        if mode == "registered":
            replica.inbox.put(("register", staged.named))
            replica.expect("registered")
        for mib in bucket_mib:
            capacity = max(mib << 20, largest)
            if mode == "staged":
                buffers = [StagingBuffer(capacity) for _ in range(2)]
                replica.inbox.put(("attach", [b.handle() for b in buffers]))
                replica.expect("attached")
            times = []
            for _ in range(repeats + 1):  # the first one opens the IPC handles
                version += 1
                start = time.perf_counter()
                if mode == "staged":
                    written = push_staged(replica, staged, [b.buffer for b in buffers], capacity, version)
                else:
                    written = push(replica, staged, mode, mib << 20, version, window)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])
            rows.append({"mode": mode, "bucket_mib": capacity >> 20 if mode == "staged" else mib, "seconds": seconds, "written": written,
                         "GBps": total / seconds / 1e9, "vs_copy": copy_s / seconds})  # fmt: skip
    replica.inbox.put(("digests",))
    engine = replica.expect("digests")
    rank = device_digests(dict(staged.refresh()))
    result["engine_matches_rank"] = engine == rank
    replica.stop()
    result["runs"] = rows
    best = max(rows, key=lambda r: r["GBps"])
    result["best_by_mode"] = {m: max((r for r in rows if r["mode"] == m), key=lambda r: r["GBps"]) for m in MODES}
    result["best"] = best
    return result


def show(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"update_weights by CUDA IPC: {result['bytes'] / 2**30:.2f} GiB in {result['tensors']} tensors "
        f"on {result['device']}; D2D copy {result['copy_GBps']:.0f} GB/s"
    )
    for column in ("handover", "bucket MiB", "ms", "GB/s", "of the copy"):
        table.add_column(column, justify="right")
    for r in result["runs"]:
        table.add_row(
            r["mode"], str(r["bucket_mib"]), f"{r['seconds'] * 1e3:.2f}", f"{r['GBps']:.0f}", f"{r['vs_copy']:.0%}"
        )
    Console().print(table)
    best = result["best"]
    print(
        f"best: {best['mode']} with {best['bucket_mib']} MiB buckets, {best['GBps']:.0f} GB/s = {best['vs_copy']:.0%} of the copy"
    )
    print(f"engine weights bit-identical to the rank's converted tensors: {result['engine_matches_rank']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=[p for p in PRESETS if p != "tiny"] + ["tiny"], default="llama-1b")
    parser.add_argument("--buckets-mib", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=2, help="buckets in flight before the rank waits")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("update_weights by CUDA IPC needs a CUDA device; none is visible")
    result = run(preset(args.preset), args.buckets_mib, args.repeats, args.window)
    print(json.dumps(result)) if args.json else show(result)


if __name__ == "__main__":
    main()
