"""On a GPU: the plan against torch_memory_saver regions, and the memory guard refusing a restore
that the driver's free memory cannot hold (another tenant's cudaMalloc fills the device)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_regions_match_the_plan_and_the_guard_refuses_what_does_not_fit() -> None:
    pytest.importorskip("torch_memory_saver")
    pytest.importorskip("cupy")
    from benchmarks.plan_vs_measured import measure, planned, rows

    (got,) = measure("gpu-1b", [1])["runs"]["1"]
    for name, want, have in rows(planned("gpu-1b", 1), got):
        if "above the bare process" not in name:  # those carry the process's own residue
            assert abs(have / want - 1) <= 0.05 if want else have == 0, (name, want, have)
    refusal = got["refusal"]
    assert refusal["refused_ok"] is False and "needs" in refusal["reason"] and "free on" in refusal["reason"]
    assert refusal["free_after"] == refusal["free_before"]  # asking allocated nothing
    assert refusal["admitted_ok"] is True
