"""Digest rate: the device digest and SHA256 of a model's worth of bf16 params, against a
device-to-device copy of the same bytes measured in the same run.

The params are Llama-shaped (q, k, v, o, gate, up, down and two norms per layer, 32 layers,
embeddings and output: 291 tensors), scaled so that together they hold about `--gib` GiB, and
are views into one flat buffer, as Megatron's param buffer holds them. On CUDA every time is
taken between CUDA events, after a warm-up, as the median of `--repeats`; on the CPU (a check
that the script runs, at a small `--gib`) by the host clock.

Rates are in GB/s (1e9 bytes):

- `digest_gbps`, `sha256_gbps`: bytes digested per second, each byte counted once;
- `d2d_copy_gbps`: bytes read plus bytes written per second by one copy of the whole buffer
  (twice the bytes copied): what the memory moves, the ceiling a pass over the bytes meets;
- `ratio`: `digest_gbps / d2d_copy_gbps`.

`digest_path` says which computed the device digest: `triton` (`digest_kernel`, one launch for
all the params; on CUDA where Triton imports) or `torch` (reductions per param).

    python benchmarks/digest_rate.py [--gib 4] [--repeats 5] [--row-words 1024] [--block-words 131072]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from orchestrator.adapters import digest, digest_kernel

LAYERS = 32
HIDDEN, KV, FFN, VOCAB = 2048, 512, 8192, 128256  # Llama 3.2 1B, the scale of 1.0


def shapes(scale: float) -> list[tuple[str, tuple[int, ...]]]:
    """The params' names and shapes at `scale` times Llama 3.2 1B's widths (64-aligned)."""

    def width(n: int) -> int:
        return max(64, round(n * scale / 64) * 64)

    h, kv, ffn, vocab = width(HIDDEN), width(KV), width(FFN), width(VOCAB)
    layer: dict[str, tuple[int, ...]] = {
        "q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h),
        "gate": (ffn, h), "up": (ffn, h), "down": (h, ffn), "input_norm": (h,), "post_norm": (h,),
    }  # fmt: skip
    named: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, h))]
    named += [(f"layers.{i}.{part}", shape) for i in range(LAYERS) for part, shape in layer.items()]
    return [*named, ("norm", (h,)), ("output", (vocab, h))]


def model_like(gib: float, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat bf16 buffer of about `gib` GiB and the params as views into it."""
    at_one = sum(math.prod(s) for _, s in shapes(1.0)) * 2
    named = shapes(math.sqrt(gib * (1 << 30) / at_one))
    flat = torch.randn(sum(math.prod(s) for _, s in named), device=device, dtype=torch.bfloat16)
    params, offset = {}, 0
    for name, shape in named:
        size = math.prod(shape)
        params[name] = flat[offset : offset + size].view(shape)
        offset += size
    return flat, params


def seconds(work: Callable[[], Any], repeats: int, cuda: bool) -> float:
    """Median seconds of `work` after one warm-up call; `work` ends with its results on the host."""
    work()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            work()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def run(gib: float, repeats: int, sha256_repeats: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    flat, params = model_like(gib, device)
    copy = torch.empty_like(flat)
    size = flat.numel() * flat.element_size()
    first = digest.device_digests(params)

    def copied() -> None:
        copy.copy_(flat)
        if cuda:
            torch.cuda.synchronize()

    digest_s = seconds(lambda: digest.device_digests(params), repeats, cuda)
    sha256_s = seconds(lambda: digest.sha256_digests(params), sha256_repeats, cuda)
    copy_s = seconds(copied, repeats, cuda)
    digest_gbps, copy_gbps = size / digest_s / 1e9, 2 * size / copy_s / 1e9
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "bytes": size,
        "tensors": len(params),
        "row_words": digest.ROW_WORDS,
        "digest_path": "triton" if digest_kernel.kernel_available(device, digest.ROW_WORDS) else "torch",
        "block_words": digest_kernel.BLOCK_WORDS,
        "digest_ms": digest_s * 1e3,
        "sha256_ms": sha256_s * 1e3,
        "d2d_copy_ms": copy_s * 1e3,
        "digest_gbps": digest_gbps,
        "sha256_gbps": size / sha256_s / 1e9,
        "d2d_copy_gbps": copy_gbps,
        "d2d_copy_counts": "bytes read + bytes written (2x the bytes copied)",
        "ratio": digest_gbps / copy_gbps,
        "digest_stable": digest.device_digests(params) == first,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv` (the command line's when None), measure, print the JSON and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="GiB of bf16 params, in all")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of the digest and the copy")
    parser.add_argument("--sha256-repeats", type=int, default=2, help="timed SHA256 calls (seconds each on a GPU)")
    parser.add_argument("--row-words", type=int, default=digest.ROW_WORDS, help="the device digest's row length")
    parser.add_argument(
        "--block-words", type=int, default=digest_kernel.BLOCK_WORDS, help="words per program of the Triton digest"
    )
    args = parser.parse_args(argv)
    digest.ROW_WORDS = args.row_words
    digest_kernel.BLOCK_WORDS = args.block_words
    result = run(args.gib, args.repeats, args.sha256_repeats)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
