"""Both digests change with one flipped bit and agree with themselves otherwise; the device
digest catches every bit position and every swap of two distinct words, and is the sums its
docstring defines."""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch

from orchestrator.adapters import digest, digest_kernel
from orchestrator.adapters.digest import DIGESTS, DigestMethod, default_digest, device_digests

MASK = (1 << 64) - 1


def reference(tensor: torch.Tensor, k: int) -> str:
    """The device digest from its definition, in Python integers, word by word."""
    raw = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())
    padded = raw + bytes(-len(raw) % (4 * k) or 0)
    words = [int.from_bytes(padded[i : i + 4], "little", signed=True) for i in range(0, len(padded), 4)]
    rows = [words[r * k : (r + 1) * k] for r in range(len(words) // k)]

    def as_int32(total: int) -> int:
        return (total + (1 << 31)) % (1 << 32) - (1 << 31)

    row_sums = [as_int32(sum(row)) for row in rows]
    col_sums = [as_int32(sum(row[c] for row in rows)) for c in range(k)] if rows else [0] * k
    four = (
        sum(row_sums),
        sum((r + 1) * s for r, s in enumerate(row_sums)),
        sum(col_sums),
        sum((c + 1) * s for c, s in enumerate(col_sums)),
    )
    return "".join(f"{v & MASK:016x}" for v in four) + f":{len(raw)}"


def samples() -> dict[str, torch.Tensor]:
    """Several dtypes and sizes: a body of full rows and a partial last row, byte counts that are
    not whole words, a tensor smaller than a row, an empty one."""
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3001, generator=g).bfloat16(),
        "fp32": torch.randn(50, 41, generator=g),
        "int64": torch.randint(-(2**62), 2**62, (1029,), generator=g),
        "uint8": torch.randint(0, 256, (5003,), generator=g, dtype=torch.uint8),
        "tiny": torch.randn(3, generator=g).bfloat16(),
        "empty": torch.empty(0),
    }


@pytest.fixture(params=[digest.ROW_WORDS, 16], ids=["rows-default", "rows-16"])
def row_words(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(digest, "ROW_WORDS", request.param)
    return int(request.param)


def test_the_device_digest_is_its_definition(row_words: int) -> None:
    tensors = samples()
    assert device_digests(tensors) == {name: reference(t, row_words) for name, t in tensors.items()}


def test_every_bit_position_flipped_changes_the_device_digest(row_words: int) -> None:
    """All 8 * itemsize bits of the first, middle and last element and of one in the last,
    partial row (zero-padded where the bytes are not whole words), all in one call."""
    for dtype_name, tensor in samples().items():
        n = tensor.numel()
        if n == 0:
            continue
        flat = tensor.reshape(-1)
        bits = 8 * tensor.element_size()
        tail_start = (n * tensor.element_size()) // (4 * row_words) * (4 * row_words) // tensor.element_size()
        positions = sorted({0, n // 2, n - 1, min(tail_start, n - 1)})
        variants = {}
        for pos, bit in itertools.product(positions, range(bits)):
            raw = flat.clone().view(torch.uint8).reshape(n, tensor.element_size())
            raw[pos, bit // 8] ^= 1 << (bit % 8)
            variants[f"{pos}:{bit}"] = raw.reshape(-1).view(tensor.dtype)
        original = device_digests({"t": flat})["t"]
        flipped = device_digests(variants)
        assert len(flipped) == len(positions) * bits
        same = [key for key, d in flipped.items() if d == original]
        assert not same, f"{dtype_name}: these (element, bit) flips leave the digest unchanged: {same}"


def test_every_swap_of_two_distinct_words_changes_the_device_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 8 words: 61 words give 7 full rows and a partial one, so the pairs share a row,
    a column, both or neither; a few equal words make swaps that must change nothing."""
    monkeypatch.setattr(digest, "ROW_WORDS", 8)
    words = torch.randint(-(2**31), 2**31, (61,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    words[[5, 40]] = int(words[9])
    words = words.to(torch.int32)
    original = device_digests({"t": words})["t"]
    pairs = list(itertools.combinations(range(words.numel()), 2))
    variants = {}
    for i, j in pairs:
        swapped = words.clone()
        swapped[[i, j]] = swapped[[j, i]]
        variants[f"{i},{j}"] = swapped
    digests = device_digests(variants)
    for i, j in pairs:
        assert (digests[f"{i},{j}"] != original) == bool(words[i] != words[j]), (i, j)


def test_extreme_words_swapped_across_rows_change_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Words 2**32 - 1 apart, where the row sums wrap: P or Wr still changes."""
    monkeypatch.setattr(digest, "ROW_WORDS", 4)
    words = torch.tensor([-(2**31), 2**31 - 1, 2**31 - 1, 0, 2**31 - 1, -(2**31), 1, -1], dtype=torch.int32)
    original = device_digests({"t": words})["t"]
    for i, j in itertools.combinations(range(8), 2):
        swapped = words.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert (device_digests({"t": swapped})["t"] != original) == bool(words[i] != words[j]), (i, j)


def test_equal_bytes_give_equal_digests_however_laid_out() -> None:
    """Same call twice, clones, a transposed (non-contiguous) view's contiguous copy, and a view at
    an offset that is not a whole word (read from a copy): each equals its plain twin."""
    tensors = samples()
    first = device_digests(tensors)
    assert device_digests(tensors) == first
    assert device_digests({n: t.clone() for n, t in tensors.items()}) == first
    matrix = torch.randn(37, 53)
    assert device_digests({"m": matrix.t()}) == device_digests({"m": matrix.t().contiguous()})
    base = torch.arange(100, dtype=torch.int16)
    assert device_digests({"v": base[1:64]}) == device_digests({"v": base[1:64].clone()})


def test_the_kernel_runs_on_cuda_only_with_rows_a_power_of_two() -> None:
    assert not digest_kernel.kernel_available(torch.device("cpu"), 1024)
    assert not digest_kernel.kernel_available(torch.device("cuda"), 1000)


def test_a_kernel_that_fails_leaves_the_digest_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Triton kernel cannot run, a warning says so once and the torch path gives the
    same digests; the kernel is not tried again."""

    def fail(tensors: object, k: int) -> None:
        calls.append(k)
        raise RuntimeError("no kernel here")

    calls: list[int] = []
    monkeypatch.setattr(digest_kernel, "unavailable", None)
    monkeypatch.setattr(digest_kernel, "kernel_available", lambda device, k: digest_kernel.unavailable is None)
    monkeypatch.setattr(digest_kernel, "block_sums", fail)
    tensors = samples()
    expected = {name: reference(t, digest.ROW_WORDS) for name, t in tensors.items()}
    with pytest.warns(RuntimeWarning, match="no kernel here"):
        assert device_digests(tensors) == expected
    assert device_digests(tensors) == expected
    assert calls == [digest.ROW_WORDS] and "no kernel here" in str(digest_kernel.unavailable)


@pytest.mark.parametrize("method", list(DigestMethod))
def test_one_flipped_bit_changes_only_that_digest(method: DigestMethod) -> None:
    tensors = {"w": torch.randn(1000, dtype=torch.bfloat16), "b": torch.randn(3, dtype=torch.bfloat16)}
    before = DIGESTS[method](tensors)
    assert DIGESTS[method](tensors) == before
    tensors["w"].view(torch.int16)[517] ^= 1 << 4
    after = DIGESTS[method](tensors)
    assert after["w"] != before["w"] and after["b"] == before["b"]


def test_the_default_is_the_device_digest_on_a_gpu_only() -> None:
    assert default_digest("cuda") is DigestMethod.DEVICE
    assert default_digest(torch.device("cuda", 1)) is DigestMethod.DEVICE
    assert default_digest("cpu") is DigestMethod.SHA256


def test_sha256_is_sha256_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "CHUNK_BYTES", 7)
    t = torch.arange(50, dtype=torch.int16)
    assert digest.sha256_digests({"t": t})["t"] == hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_sha256_leaves_the_storage_resizable() -> None:
    t = torch.zeros(64)
    digest.sha256_digests({"t": t})
    t.untyped_storage().resize_(0)  # a numpy view would have pinned it
