"""Per-tensor digests that prove a restore bit-identical.

- `sha256`: SHA256 of each tensor's bytes on the host, tensors and 64 MiB chunks spread over
  threads (hashlib releases the GIL on large buffers). Strong, but every byte crosses to the
  host: on a GPU it made the verified cycles cost seconds.
- `device`: four 64-bit sums over each tensor's 32-bit words, computed where the tensor lives
  and one transfer to the host per device for the whole mapping. On CUDA one Triton launch reads
  every tensor's bytes once (`digest_kernel`); elsewhere two torch reductions per tensor. Not
  cryptographic: it only has to catch accidental damage (a flipped bit, a word out of place),
  at device bandwidth. `default_digest` picks it for CUDA tensors.

The device digest, and why it catches what it must
--------------------------------------------------

A tensor's bytes, zero-padded to whole rows, are read as a matrix `M` of int32 words with
`ROW_WORDS` (K) columns and R rows. Two reductions (row sums and column sums, each `torch.sum`
with an int32 accumulator, so no widened copy of the data is ever made) give, modulo 2**32:

    row_r = sum_k M[r, k]        col_k = sum_r M[r, k]

Each is taken as its int32 value (the one representative in [-2**31, 2**31)), and, modulo 2**64:

    P = sum_r row_r    Wr = sum_r (r + 1) row_r    Q = sum_k col_k    Wc = sum_k (k + 1) col_k

The digest is `P Wr Q Wc` in hex, then `:` and the byte count (so padding never aliases).

- A flipped bit changes one word by +-2**b, b < 32: its row sum changes modulo 2**32, so its int32
  value changes by some d with 0 < |d| < 2**32, and P by d, which is not 0 modulo 2**64.
- Two distinct words swapped, in rows r1 != r2: the two row values change by d1 and d2, with
  d1 = -d2 modulo 2**32 and both nonzero. Either d1 + d2 = +-2**32 and P changes, or d2 = -d1 and
  Wr changes by (r1 - r2) d1, nonzero and under 2**63 in size while R < 2**31. In the same row
  the columns differ, and Q or Wc changes the same way.

Integer addition is associative modulo 2**32, so the sums do not depend on the order a kernel
adds in: the same bytes give the same digest on every call and every device, and by either path
(`digest_kernel` sums blocks of rows, then adds the blocks' partials).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate

import torch

from orchestrator.adapters import digest_kernel
from orchestrator.core.config import DigestMethod
from orchestrator.telemetry.tracing import carried

CHUNK_BYTES = 64 << 20
ROW_WORDS = 1024  # K: 4 KiB rows; each tensor's column sums take K words, its row sums 1/K of it
_MASK = (1 << 64) - 1


def default_digest(device: torch.device | str) -> DigestMethod:
    """The device digest for tensors on a GPU, where SHA256 would copy every byte to the host;
    SHA256 on the CPU, where the bytes are already there."""
    return DigestMethod.DEVICE if torch.device(device).type == "cuda" else DigestMethod.SHA256


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _sha256(tensor: torch.Tensor) -> str:
    raw = _bytes(tensor)
    digest = hashlib.sha256()
    for start in range(0, raw.numel(), CHUNK_BYTES):
        # Always a copy: a numpy view would pin the storage, and a pinned storage can't be freed.
        digest.update(raw[start : start + CHUNK_BYTES].to("cpu", copy=True).numpy().data)
    return digest.hexdigest()


def sha256_digests(tensors: Mapping[str, torch.Tensor], threads: int = 8) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(zip(tensors, pool.map(carried(_sha256), tensors.values()), strict=True))


def device_digests(tensors: Mapping[str, torch.Tensor], threads: int = 1) -> dict[str, str]:
    """The device digest of each tensor (module docstring); `threads` is unused, as the work
    runs on the tensors' device. Tensors are grouped by device, one transfer to the host each."""
    groups: dict[torch.device, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(tensor.device, {})[name] = tensor
    digests: dict[str, str] = {}
    for group in groups.values():
        digests.update(_device_group(group))
    return {name: digests[name] for name in tensors}


def _device_group(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The four sums of every tensor of one device, then one transfer to the host: on CUDA by
    `digest_kernel` (one launch for all the tensors), elsewhere by torch reductions per tensor."""
    k = ROW_WORDS
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    device = next(iter(tensors.values())).device
    kernel = (
        digest_kernel.try_block_sums(list(tensors.values()), k) if digest_kernel.kernel_available(device, k) else None
    )
    sums = _column_sums(*kernel) if kernel is not None else _torch_sums(tensors, sizes, k)
    four = sums.cpu().tolist()
    return {
        name: "".join(f"{value & _MASK:016x}" for value in sums) + f":{size}"
        for name, sums, size in zip(tensors, four, sizes, strict=True)
    }


def _column_sums(cols: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[tensors, 4] int64: P and Wr as given in `rows`, then Q and Wc from the column sums `cols`."""
    cols = cols.long()
    column = torch.arange(1, cols.shape[1] + 1, dtype=torch.int64, device=cols.device)
    return torch.cat([rows, cols.sum(1, keepdim=True), (cols * column).sum(1, keepdim=True)], dim=1)


def _torch_sums(tensors: Mapping[str, torch.Tensor], sizes: list[int], k: int) -> torch.Tensor:
    """Row and column sums of every tensor into shared buffers, then all the 64-bit sums at
    once: per tensor only its two reductions (and a copy of its last, partial row)."""
    full_rows = [size // (4 * k) for size in sizes]
    starts = list(accumulate(full_rows, initial=0))
    device = next(iter(tensors.values())).device
    rows = torch.empty(starts[-1], dtype=torch.int32, device=device)
    cols = torch.zeros(len(sizes), k, dtype=torch.int32, device=device)
    tails = torch.zeros(len(sizes), 4 * k, dtype=torch.uint8, device=device)  # last rows, zero-padded
    for i, tensor in enumerate(tensors.values()):
        raw = _bytes(tensor)
        if raw.storage_offset() % 4:  # a view at an odd offset cannot be read as int32 in place
            raw = raw.clone()
        body = full_rows[i] * 4 * k
        if body:
            words = raw[:body].view(torch.int32).view(full_rows[i], k)
            torch.sum(words, 1, dtype=torch.int32, out=rows[starts[i] : starts[i + 1]])
            torch.sum(words, 0, dtype=torch.int32, out=cols[i])
        if sizes[i] > body:
            tails[i, : sizes[i] - body].copy_(raw[body:])
    return _sums(rows, cols, tails.view(torch.int32), starts)


def _sums(rows: torch.Tensor, cols: torch.Tensor, tails: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """[tensors, 4] int64: P, Wr, Q, Wc of each tensor (module docstring), modulo 2**64 as
    int64 arithmetic wraps. `rows` holds every tensor's full rows back to back (tensor i's from
    `starts[i]`), `cols` each one's column sums over them, `tails` each one's last, partial row."""
    device = rows.device
    tail_rows = tails.sum(1, dtype=torch.int32).long()
    cols = cols + tails  # int32 addition wraps: still each column's sum modulo 2**32
    values = rows.long()
    position = torch.arange(1, values.numel() + 1, dtype=torch.int64, device=device)
    zero = values.new_zeros(1)
    # Per-tensor sums as differences of running sums: one pass for all tensors.
    running = torch.cat([zero, values.cumsum(0)])
    running_weighted = torch.cat([zero, (values * position).cumsum(0)])
    bounds = torch.tensor(starts, dtype=torch.int64, device=device)
    first, end = bounds[:-1], bounds[1:]
    plain = running[end] - running[first]
    weighted = running_weighted[end] - running_weighted[first] - first * plain  # rows count from 1 in each tensor
    row_plain = plain + tail_rows
    row_weighted = weighted + (end - first + 1) * tail_rows
    return _column_sums(cols, torch.stack([row_plain, row_weighted], dim=1))


DIGESTS: dict[DigestMethod, Callable[..., dict[str, str]]] = {
    DigestMethod.SHA256: sha256_digests,
    DigestMethod.DEVICE: device_digests,
}
