"""On a GPU: torch_memory_saver regions keep `default`'s contents through a host arena pinned once.

Three cycles of pause and resume: the contents come back bit for bit, the arena is laid out once
and keeps its host address, it holds exactly the region's bytes (page-aligned), and the device's
free memory after each resume is the same (nothing leaks from one cycle to the next).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1 << 20


def test_three_cycles_through_one_pinned_arena() -> None:
    pytest.importorskip("torch_memory_saver")
    from orchestrator.adapters.regions.tms import TorchMemorySaverRegions
    from states import Region

    default = [torch.randn(64 * MiB // 4, device="cuda"), torch.randn(3 * MiB // 4 + 1, device="cuda")]
    tensors = {Region.DEFAULT.value: default, Region.GRAD_BUFFER.value: [], Region.PARAM_BUFFER.value: []}
    regions = TorchMemorySaverRegions(lambda: tensors)
    arena = regions._arenas[Region.DEFAULT.value]
    free_after_resume, host_addresses = [], []
    for _ in range(3):
        expected = [t.clone().cpu() for t in default]
        freed = regions.pause(Region.DEFAULT.value)
        assert freed >= 64 * MiB, freed
        regions.resume(Region.DEFAULT.value)
        assert all(torch.equal(t.cpu(), e) for t, e in zip(default, expected, strict=True))
        for t in default:
            t.add_(1)  # a step changes the optimizer state
        torch.cuda.synchronize()
        free_after_resume.append(torch.cuda.mem_get_info()[0])
        assert arena._block is not None
        host_addresses.append(arena._block.data_ptr())
    assert arena.layouts == 1 and len(set(host_addresses)) == 1
    assert regions.host_arena_bytes() == 64 * MiB + (3 * MiB + 4096)  # each storage page-aligned
    assert max(free_after_resume) - min(free_after_resume) <= 2 * MiB, free_after_resume
    regions.pause(Region.DEFAULT.value)
    assert regions.pause(Region.DEFAULT.value) == 0  # a no-op, not torch_memory_saver's exit(1)
    regions.resume(Region.DEFAULT.value)
    assert regions.resume(Region.DEFAULT.value) == 0
    assert regions.paused == frozenset()
    regions.close()
    assert regions.host_arena_bytes() == 0
