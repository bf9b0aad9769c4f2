"""The Triton digest kernel, run on the CPU by Triton's interpreter: it gives the torch path's
digests (the definition's) on layouts like Megatron's param buffer (many views into one buffer,
odd sizes, odd byte offsets), across blocks and tiles, and with every bit flipped. Skipped where
Triton is not installed; on a GPU, tests/gpu/test_device_digest.py runs the compiled kernel.

Triton reads TRITON_INTERPRET when it is imported, and setting it for the whole test session
would interpret every kernel of the GPU tests too: so the kernel's tests here run in a child
pytest with it set (`test_the_kernel_interpreted`), and skip in the parent."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from orchestrator.adapters import digest, digest_kernel
from orchestrator.adapters.digest import device_digests
from tests.unit.test_digest import reference, samples

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def test_the_kernel_interpreted() -> None:
    """This module's kernel tests, in a child pytest under TRITON_INTERPRET=1."""
    if INTERPRETED:
        pytest.skip("this is the child")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", __file__]
    child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout and " failed" not in child.stdout


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`device_digests` takes the kernel on the CPU, interpreted, with blocks of 8 tiles of 256
    words, so a few thousand words already span several tiles and blocks."""
    if not INTERPRETED:
        pytest.skip("runs in the child of test_the_kernel_interpreted")
    monkeypatch.setattr(digest_kernel, "BLOCK_WORDS", 2048)
    monkeypatch.setattr(digest_kernel, "TILE_WORDS", 256)
    monkeypatch.setattr(digest_kernel, "kernel_available", lambda device, k: True)
    monkeypatch.setattr(digest_kernel, "try_block_sums", digest_kernel.block_sums)  # no quiet fallback
    yield


def torch_path(tensors: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    with monkeypatch.context() as patch:
        patch.setattr(digest_kernel, "kernel_available", lambda device, k: False)
        return device_digests(tensors)


def buffer_views(seed: int, count: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """`count` views into one flat buffer, as Megatron's param buffer holds params: random sizes
    (whole blocks, a word short of one, a few bytes), at random offsets in elements, so some
    start on 16-byte boundaries, some on 4-byte ones, some on neither (for 1- and 2-byte types)."""
    g = torch.Generator().manual_seed(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    sizes = [
        int(torch.randint(1, 5000, (1,), generator=g)) if i % 3 else (2048 * 4 // width) * (i % 5 + 1) - i % 2
        for i in range(count)
    ]
    gaps = [int(torch.randint(0, 9, (1,), generator=g)) for _ in range(count)]
    flat = torch.randint(-(2**31), 2**31, ((sum(sizes) + sum(gaps)) * width // 4 + 1,), generator=g, dtype=torch.int64)
    flat = flat.to(torch.int32).view(torch.uint8).view(dtype).to(device)
    views, at = {}, 0
    for i, (size, gap) in enumerate(zip(sizes, gaps, strict=True)):
        at += gap
        views[f"p{i}"] = flat[at : at + size]
        at += size
    return views


def alignments(tensors: dict[str, torch.Tensor]) -> set[int]:
    """The kernel's launch classes among the tensors: 16-byte, 4-byte, other starts."""
    return {next(a for a in (16, 4, 1) if t.data_ptr() % a == 0) for t in tensors.values()}


@pytest.mark.parametrize("k", [digest.ROW_WORDS, 16, 4])
def test_the_kernel_digest_is_the_definition(kernel: None, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "ROW_WORDS", k)
    tensors = samples()
    base = torch.randn(40_000, generator=torch.Generator().manual_seed(3)).bfloat16()
    tensors |= {
        "at 2": base[1:20_001],
        "at 3": base.view(torch.uint8)[3:9_003],
        "transposed": base[:6000].view(60, 100).t(),
    }
    assert device_digests(tensors) == {name: reference(t, k) for name, t in tensors.items()}


@pytest.mark.parametrize(("seed", "dtype"), [(0, torch.bfloat16), (3, torch.uint8), (2, torch.float32)])
def test_the_kernel_equals_the_torch_path_on_buffer_views(
    kernel: None, seed: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digest, "ROW_WORDS", 64)
    views = buffer_views(seed, 16, dtype)
    assert alignments(views) == ({16, 4} if dtype == torch.float32 else {16, 4, 1})
    assert device_digests(views) == torch_path(views, monkeypatch)


@pytest.mark.parametrize("offset", [0, 1])
def test_every_bit_flipped_changes_the_kernel_digest(
    kernel: None, offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every bit of the first element, of the last of a tile, of the first of the second block
    and of the last element, in a bf16 view into a buffer at a 16-byte boundary and at 2 bytes
    past it; each flipped digest is also the torch path's."""
    monkeypatch.setattr(digest, "ROW_WORDS", 16)
    monkeypatch.setattr(digest_kernel, "BLOCK_WORDS", 1024)
    n = 2 * 2048 + 5  # bf16 elements: two blocks of 1024 words (tiles of 256) and a partial word
    base = torch.randn(n + 8, generator=torch.Generator().manual_seed(4)).bfloat16()
    original = device_digests({"t": base[offset : offset + n]})["t"]
    variants = {}
    for pos, bit in itertools.product((0, 511, 2048, n - 1), range(16)):
        flipped = base.clone()
        flipped.view(torch.uint8).view(-1, 2)[offset + pos, bit // 8] ^= 1 << (bit % 8)
        variants[f"{pos}:{bit}"] = flipped[offset : offset + n]
    digests = device_digests(variants)
    assert original not in digests.values()
    assert len(set(digests.values())) == len(variants)
    assert digests == torch_path(variants, monkeypatch)


def test_the_plan_launches_once_per_alignment_class() -> None:
    """Tensors at 16-byte, 4-byte and 2-byte boundaries: three launches, blocks of each tensor
    together, empty tensors in none."""
    plan = digest_kernel._plan([64, 68, 66, 32], [4096 * 3, 100, 4096, 0], 1, 1024, torch.device("cpu"))
    assert plan.launches == [(16, 0, 3), (4, 3, 1), (1, 4, 1)]
    assert plan.table.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]
    assert plan.owner.tolist() == [0, 0, 0, 1, 2]
    assert plan.tensors.tolist() == [[64, 68, 66, 32], [4096 * 3, 100, 4096, 0]]
