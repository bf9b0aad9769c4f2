"""On a GPU: the device digest of CUDA tensors is the one their CPU copies get (integer sums do not
depend on the order the kernels add in), and it still catches every bit flipped there. The Triton
kernel (`digest_kernel`, the path CUDA takes) gives the torch path's digests on layouts like
Megatron's param buffer, at its real block and tile sizes."""

from __future__ import annotations

import itertools

import pytest
import torch

from orchestrator.adapters import digest, digest_kernel
from orchestrator.adapters.digest import device_digests
from tests.unit.test_digest import samples
from tests.unit.test_digest_kernel import alignments, buffer_views

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def torch_path(tensors: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The digests by torch reductions, on the tensors' own device."""
    with monkeypatch.context() as patch:
        patch.setattr(digest_kernel, "kernel_available", lambda device, k: False)
        return device_digests(tensors)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel, where Triton imports, with its failures raised rather than digested by torch."""
    if not digest_kernel.kernel_available(torch.device("cuda"), digest.ROW_WORDS):
        pytest.skip("Triton is not importable")
    monkeypatch.setattr(digest_kernel, "try_block_sums", digest_kernel.block_sums)


def test_cuda_digests_equal_the_cpu_ones() -> None:
    tensors = samples()
    large = torch.randn(3, 1 << 22, generator=torch.Generator().manual_seed(2)).bfloat16()
    tensors["large"] = large
    on_gpu = {name: t.cuda() for name, t in tensors.items()}
    on_gpu["offset"] = on_gpu["large"].view(-1)[1:]  # a view at an odd offset, on the GPU
    tensors["offset"] = large.view(-1)[1:]
    assert device_digests(on_gpu) == device_digests(tensors)


def test_every_bit_flipped_on_the_gpu_changes_the_digest() -> None:
    tensor = torch.randn(3001, device="cuda").bfloat16()
    original = device_digests({"t": tensor})["t"]
    variants = {}
    for pos, bit in itertools.product((0, 1500, 3000), range(16)):
        flipped = tensor.clone()
        flipped.view(torch.uint8).view(-1, 2)[pos, bit // 8] ^= 1 << (bit % 8)
        variants[f"{pos}:{bit}"] = flipped
    assert original not in device_digests(variants).values()


@pytest.mark.parametrize(("seed", "dtype"), [(0, torch.bfloat16), (3, torch.uint8), (2, torch.float32)])
def test_the_kernel_equals_the_torch_path_on_buffer_views(
    kernel: None, seed: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Views into one buffer at 16-byte, 4-byte and odd offsets, with odd sizes, among them
    several blocks long: the kernel's digests on the GPU, the torch path's on the GPU and on the
    CPU, all equal."""
    on_gpu = buffer_views(seed, 64, dtype, "cuda")  # views into one buffer on the GPU
    assert alignments(on_gpu) == ({16, 4} if dtype == torch.float32 else {16, 4, 1})
    big = torch.randn(3 * digest_kernel.BLOCK_WORDS + 777, generator=torch.Generator().manual_seed(seed)).cuda()
    on_gpu |= {"big": big, "big at 2": big.bfloat16()[1:], "big at 1": big.view(torch.uint8)[1:-1]}
    expected = device_digests({name: t.cpu() for name, t in on_gpu.items()})  # the CPU: the torch path
    assert device_digests(on_gpu) == expected
    assert torch_path(on_gpu, monkeypatch) == expected


def test_the_kernel_equals_the_torch_path_on_a_model_like_buffer(kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """291 Llama-shaped bf16 params of 256 MiB in all, views into one flat buffer (the benchmark's
    layout), then the same with every param a few elements off its place."""
    from benchmarks.digest_rate import model_like

    flat, params = model_like(0.25, torch.device("cuda"))
    assert device_digests(params) == torch_path(params, monkeypatch)
    shifted, at = {}, 3  # 6 bytes in, then one element more per param: 4- and 2-byte aligned in turn
    for name, param in params.items():
        if at + param.numel() > flat.numel():
            break
        shifted[name] = flat[at : at + param.numel()]
        at += param.numel() + 1
    assert len(shifted) > 200
    assert device_digests(shifted) == torch_path(shifted, monkeypatch)


@pytest.mark.parametrize("offset", [0, 1])
def test_every_bit_flipped_in_the_kernel_changes_the_digest(
    kernel: None, offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every bit of elements at the start, a tile edge, a block edge and the end of a bf16 view
    three blocks long, 16-byte aligned and 2 bytes off: each flip changes the kernel's digest, to
    the torch path's digest of the same bytes."""
    n = 6 * digest_kernel.BLOCK_WORDS + 3
    base = torch.randn(n + 8, device="cuda").bfloat16()
    original = device_digests({"t": base[offset : offset + n]})["t"]
    positions = (0, 2 * digest_kernel.TILE_WORDS - 1, 2 * digest_kernel.BLOCK_WORDS, n - 1)
    variants = {}
    for pos, bit in itertools.product(positions, range(16)):
        flipped = base.clone()
        flipped.view(torch.uint8).view(-1, 2)[offset + pos, bit // 8] ^= 1 << (bit % 8)
        variants[f"{pos}:{bit}"] = flipped[offset : offset + n]
    digests = device_digests(variants)
    assert original not in digests.values()
    assert len(set(digests.values())) == len(variants)
    assert digests == torch_path(variants, monkeypatch)
