"""Both digests change with one flipped bit and agree with themselves otherwise."""

from __future__ import annotations

import hashlib

import pytest
import torch

from orchestrator.adapters import digest
from orchestrator.adapters.digest import DIGESTS, DigestMethod


@pytest.mark.parametrize("method", list(DigestMethod))
def test_one_flipped_bit_changes_only_that_digest(method: DigestMethod) -> None:
    tensors = {"w": torch.randn(1000, dtype=torch.bfloat16), "b": torch.randn(3, dtype=torch.bfloat16)}
    before = DIGESTS[method](tensors)
    assert DIGESTS[method](tensors) == before
    tensors["w"].view(torch.int16)[517] ^= 1 << 4
    after = DIGESTS[method](tensors)
    assert after["w"] != before["w"] and after["b"] == before["b"]


def test_device_digest_catches_swapped_words() -> None:
    t = torch.arange(8, dtype=torch.int32).float()
    swapped = t.clone()
    swapped[[2, 5]] = swapped[[5, 2]]
    assert digest.device_digests({"t": t}) != digest.device_digests({"t": swapped})


def test_sha256_is_sha256_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "CHUNK_BYTES", 7)
    t = torch.arange(50, dtype=torch.int16)
    assert digest.sha256_digests({"t": t})["t"] == hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_sha256_leaves_the_storage_resizable() -> None:
    t = torch.zeros(64)
    digest.sha256_digests({"t": t})
    t.untyped_storage().resize_(0)  # a numpy view would have pinned it
