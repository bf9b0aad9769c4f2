"""On a GPU: the device digest of CUDA tensors is the one their CPU copies get (integer sums do not
depend on the order the kernels add in), and it still catches every bit flipped there."""

from __future__ import annotations

import itertools

import pytest
import torch

from orchestrator.adapters.digest import device_digests
from tests.unit.test_digest import samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_digests_equal_the_cpu_ones() -> None:
    tensors = samples()
    large = torch.randn(3, 1 << 22, generator=torch.Generator().manual_seed(2)).bfloat16()
    tensors["large"], tensors["offset"] = large, large.view(-1)[1:]  # a view at an odd offset
    on_gpu = device_digests({name: t.cuda() for name, t in tensors.items()})
    assert on_gpu == device_digests(tensors)


def test_every_bit_flipped_on_the_gpu_changes_the_digest() -> None:
    tensor = torch.randn(3001, device="cuda").bfloat16()
    original = device_digests({"t": tensor})["t"]
    variants = {}
    for pos, bit in itertools.product((0, 1500, 3000), range(16)):
        flipped = tensor.clone()
        flipped.view(torch.uint8).view(-1, 2)[pos, bit // 8] ^= 1 << (bit % 8)
        variants[f"{pos}:{bit}"] = flipped
    assert original not in device_digests(variants).values()
