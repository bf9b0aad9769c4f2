"""The device digest's sums for many tensors in one Triton launch (`orchestrator.adapters.digest`).

Two torch reductions per tensor held the digest of 291 params (4.31 GB) to 252 GB/s on an H200,
where a copy of the same bytes moves 4 TB/s: the launches, not the bytes, set the pace. Here, as
in `orchestrator.adapters.megatron.fast_cast`, a table maps each program of one launch to one
block of one tensor and the tensors' addresses are read from another, so any number of tensors
(views into one param buffer or separate storages alike) take one launch.

Each program reads up to `BLOCK_WORDS` words of one tensor, whole rows of K words (the digest's
matrix, module docstring of `digest`), tile by tile, and writes its partials: the K column sums
of its rows (int32, wrapping), and P and Wr over its rows (int64, wrapping; a row's weight is its
index in the whole tensor, so partials just add). Every partial is a sum modulo 2**32 or 2**64,
so adding them in any order, by `index_add_`, gives exactly the sums of the torch path, and the
same digest, on any device.

Tiles of whole words are loaded as int32, as 16-byte vectors in the launch whose tensors all
start on 16-byte boundaries (one launch per alignment class: 16 bytes, 4 bytes, other). The
rest, the rows at a tensor's end and all of a tensor that starts off a 4-byte boundary, is
assembled from bytes in smaller tiles, masked to the tensor's bytes and the block's rows: nothing
outside a tensor is read, and a partial last word is zero-padded as the definition says.

Triton runs only on CUDA here; `digest` keeps its torch path for every other device, and takes it
for good in a process where the kernel fails to compile or launch (`try_block_sums`). The first
call compiles the kernel, once per alignment class and row length (Triton caches it on disk). On
the CPU, `TRITON_INTERPRET=1` runs this kernel for the tests.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["block_sums", "kernel_available"]

BLOCK_WORDS = 1 << 17  # words per program (512 KiB): its K column partials cost 1/128 of its bytes
TILE_WORDS = 1 << 13  # words per tile (32 KiB): 32 per thread of 8 warps, eight 16-byte loads each
BYTE_WORDS = 1 << 10  # words per tile assembled from bytes (4 per thread): 16 byte loads each
_ALIGNMENTS = (16, 4, 1)  # byte alignment of a launch's tensors: 16-byte vectors, int32 words, bytes


class Launch(NamedTuple):
    """One launch of the kernel: its tensors' alignment, its first block in the table, its blocks."""

    alignment: int
    start: int
    blocks: int


class Plan(NamedTuple):
    """What the launches read: `tensors` [2, n] int64 (each tensor's address, then its size in
    bytes), `owner` [blocks] (each block's tensor), `table` [blocks, 2] (its tensor, first row)."""

    tensors: torch.Tensor
    owner: torch.Tensor
    table: torch.Tensor
    launches: list[Launch]


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, built lazily; None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def digest_blocks(
        addresses, sizes, blocks, cols_out, sums_out,
        K: tl.constexpr, TILE_ROWS: tl.constexpr, BYTE_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        ALIGN: tl.constexpr,
    ):  # fmt: skip
        program = tl.program_id(0)
        tensor = tl.load(blocks + 2 * program)
        first_row = tl.load(blocks + 2 * program + 1)
        size = tl.load(sizes + tensor)
        address = tl.load(addresses + tensor)
        rows = tl.minimum((size + 4 * K - 1) // (4 * K) - first_row, BLOCK_ROWS)
        # Rows in whole tiles of whole words are loaded as int32 (16-byte vectors where ALIGN says
        # so); the rest, the end of a tensor or all of an unaligned one, is assembled from bytes.
        fast = tl.minimum(rows, tl.maximum(size // (4 * K) - first_row, 0)) // TILE_ROWS * TILE_ROWS
        if ALIGN < 4:
            fast = fast * 0
        words = address.to(tl.pointer_type(tl.int32))
        if ALIGN >= 16:
            words = tl.multiple_of(words, 16)
        offsets = tl.arange(0, TILE_ROWS)[:, None] * K + tl.arange(0, K)[None, :]
        cols = tl.zeros([K], tl.int32)
        p = tl.zeros([TILE_ROWS], tl.int64)
        wr = tl.zeros([TILE_ROWS], tl.int64)
        for tile in range(0, fast, TILE_ROWS):
            row = first_row + tile
            values = tl.load(words + row * K + offsets)
            cols += tl.sum(values, axis=0)
            row_sums = tl.sum(values, axis=1).to(tl.int64)  # each row's int32 sum, as its int32 value
            p += row_sums
            wr += row_sums * (row + 1 + tl.arange(0, TILE_ROWS))
        # The rest in tiles of about 1024 words: a larger tile's byte pointers would take registers
        # from the loop above, and so cost it occupancy.
        offsets = tl.arange(0, BYTE_ROWS)[:, None] * K + tl.arange(0, K)[None, :]
        p_bytes = tl.zeros([BYTE_ROWS], tl.int64)
        wr_bytes = tl.zeros([BYTE_ROWS], tl.int64)
        for tail in range(fast, rows, BYTE_ROWS):
            row = first_row + tail
            raw = address.to(tl.pointer_type(tl.uint8)) + row * K * 4
            # bytes from `raw` on that are the tensor's and this block's: the mask keeps both
            left = tl.minimum(size - row * K * 4, (rows - tail) * K * 4).to(tl.int32)
            assembled = tl.zeros([BYTE_ROWS, K], tl.uint32)
            for j in tl.static_range(4):  # little-endian, as `view`; zeros past the end
                byte = tl.load(raw + offsets * 4 + j, mask=offsets * 4 + j < left, other=0)
                assembled = assembled | (byte.to(tl.uint32) << (8 * j))
            values = assembled.to(tl.int32, bitcast=True)
            cols += tl.sum(values, axis=0)
            row_sums = tl.sum(values, axis=1).to(tl.int64)
            p_bytes += row_sums
            wr_bytes += row_sums * (row + 1 + tl.arange(0, BYTE_ROWS))
        tl.store(cols_out + program * K + tl.arange(0, K), cols)
        tl.store(sums_out + 2 * program, tl.sum(p, axis=0) + tl.sum(p_bytes, axis=0))
        tl.store(sums_out + 2 * program + 1, tl.sum(wr, axis=0) + tl.sum(wr_bytes, axis=0))

    return digest_blocks


unavailable: str | None = None  # why the kernel stopped being used in this process, if it did


def kernel_available(device: torch.device, k: int) -> bool:
    """True where the kernel can digest tensors on `device` with rows of `k` words: a CUDA
    device, an importable Triton that has not failed to run the kernel, and `k` a power of two
    (a tile's width)."""
    return device.type == "cuda" and k > 0 and k & (k - 1) == 0 and unavailable is None and _kernel() is not None


def try_block_sums(tensors: Sequence[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`block_sums`, or None (with a warning, and `unavailable` set) where the kernel fails to
    compile or launch: a Triton that cannot run it is no Triton, and the torch path computes
    the same digests."""
    global unavailable
    try:
        return block_sums(tensors, k)
    except Exception as error:
        unavailable = f"the Triton digest failed to run: {error!r}"
        warnings.warn(f"{unavailable}; digesting by torch reductions instead", RuntimeWarning, stacklevel=2)
        return None


def block_sums(tensors: Sequence[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cols [n, k] int32, rows [n, 2] int64) on the tensors' device, one device for all: each
    tensor's column sums modulo 2**32, and its P and Wr modulo 2**64 (`digest`'s definition).
    One launch per alignment class among the tensors, then two `index_add_` of the partials."""
    block_rows = max(1, BLOCK_WORDS // k)
    tile_rows = min(block_rows, max(1, TILE_WORDS // k))
    # A non-contiguous tensor is digested as its contiguous copy, kept alive until the launch.
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    device, n = flat[0].device, len(flat)
    plan = _plan([t.data_ptr() for t in flat], [t.numel() * t.element_size() for t in flat], block_rows, k, device)
    blocks = plan.owner.numel()
    cols_out = torch.empty(blocks, k, dtype=torch.int32, device=device)
    sums_out = torch.empty(blocks, 2, dtype=torch.int64, device=device)
    for alignment, start, count in plan.launches:
        _kernel()[(count,)](
            plan.tensors[0], plan.tensors[1], plan.table[start:], cols_out[start:], sums_out[start:],
            K=k, TILE_ROWS=tile_rows, BYTE_ROWS=min(tile_rows, max(1, BYTE_WORDS // k)), BLOCK_ROWS=block_rows,
            ALIGN=alignment, num_warps=8,
        )  # fmt: skip
    cols = torch.zeros(n, k, dtype=torch.int32, device=device).index_add_(0, plan.owner, cols_out)
    rows = torch.zeros(n, 2, dtype=torch.int64, device=device).index_add_(0, plan.owner, sums_out)
    return cols, rows


def _plan(addresses: list[int], sizes: list[int], block_rows: int, k: int, device: torch.device) -> Plan:
    """The kernel's tables on `device`, built there from one copy of a few numbers per tensor.
    Blocks are ordered by alignment class, each tensor's together, so each launch reads one
    slice of the table; empty tensors have none."""
    by_class: dict[int, list[int]] = {a: [] for a in _ALIGNMENTS}
    for i, (address, size) in enumerate(zip(addresses, sizes, strict=True)):
        if size:
            by_class[next(a for a in _ALIGNMENTS if address % a == 0)].append(i)
    block_bytes = 4 * k * block_rows
    order = [i for members in by_class.values() for i in members]
    counts = [-(-sizes[i] // block_bytes) for i in order]
    launches, at = [], 0
    for alignment, members in by_class.items():
        if members:
            launches.append(Launch(alignment, sum(counts[:at]), sum(counts[at : at + len(members)])))
        at += len(members)
    n, m, total = len(addresses), len(order), sum(counts)
    numbers = torch.tensor(addresses + sizes + order + counts, dtype=torch.int64).to(device)
    order_, counts_ = numbers[2 * n : 2 * n + m], numbers[2 * n + m :]
    owner = torch.repeat_interleave(order_, counts_, output_size=total)
    first = torch.repeat_interleave(counts_.cumsum(0) - counts_, counts_, output_size=total)
    within = torch.arange(total, dtype=torch.int64, device=device) - first
    return Plan(numbers[: 2 * n].view(2, n), owner, torch.stack([owner, within * block_rows], dim=1), launches)
