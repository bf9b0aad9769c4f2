"""Per-tensor digests that prove a restore bit-identical.

- `sha256`: SHA256 of each tensor's bytes on the host, tensors and 64 MiB chunks spread over
  threads (hashlib releases the GIL on large buffers). Strong; costs a device-to-host copy.
- `device`: two 64-bit sums over each tensor's 32-bit words, computed where the tensor lives:
  the plain sum and a position-weighted one (Fletcher-style), so a flipped bit or two swapped
  words change it. Not cryptographic; it only has to catch accidental damage, at device
  bandwidth.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

import torch

CHUNK_BYTES = 64 << 20
DEVICE_CHUNK_WORDS = 16 << 20  # bounds the int64 temporaries to 128 MiB


class DigestMethod(StrEnum):
    SHA256 = "sha256"
    DEVICE = "device"


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
        return dict(zip(tensors, pool.map(_sha256, tensors.values()), strict=True))


def _device_digest(tensor: torch.Tensor) -> str:
    raw = _bytes(tensor)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    plain = weighted = 0
    for start in range(0, words.numel(), DEVICE_CHUNK_WORDS):
        part = words[start : start + DEVICE_CHUNK_WORDS].to(torch.int64)
        positions = torch.arange(start + 1, start + 1 + part.numel(), device=part.device, dtype=torch.int64)
        plain += int(part.sum())
        weighted += int((part * positions).sum())  # int64 wraps: a checksum modulo 2**64
    return f"{plain & (2**64 - 1):016x}{weighted & (2**64 - 1):016x}:{raw.numel()}"


def device_digests(tensors: Mapping[str, torch.Tensor], threads: int = 1) -> dict[str, str]:
    return {name: _device_digest(t) for name, t in tensors.items()}


DIGESTS: dict[DigestMethod, Callable[..., dict[str, str]]] = {
    DigestMethod.SHA256: sha256_digests,
    DigestMethod.DEVICE: device_digests,
}
