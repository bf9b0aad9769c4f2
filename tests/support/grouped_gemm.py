"""A stand-in for the `grouped_gemm` package's one op that Megatron's GroupedMLP calls, on CPU.

megatron-core 0.16.1 builds the local spec's experts under `moe_grouped_gemm=True` as
`GroupedMLP`, which asserts that the `grouped_gemm` package (CUDA kernels, fanshiqing/grouped_gemm)
imports and calls `grouped_gemm.ops.gmm` in its forward. Neither runs on a CUDA-less host. This
replaces that op alone, with its definition: `gmm(a, b, batch_sizes)` multiplies the i-th run of
`batch_sizes[i]` rows of `a` by `b[i]` (by `b[i]ᵀ` with `trans_b`). Everything else, GroupedMLP's
params, their views per expert, its activation and the dispatch around it, is Megatron's own. A
GPU run of the same tests needs the real package (and no stand-in: `use_cpu_grouped_gemm` refuses
where CUDA is available).
"""

from __future__ import annotations

import types

import torch

__all__ = ["use_cpu_grouped_gemm"]


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    runs = a.split(batch_sizes.tolist())
    return torch.cat([run @ (w.t() if trans_b else w) for run, w in zip(runs, b, strict=True)])


def use_cpu_grouped_gemm() -> None:
    """Point Megatron's `grouped_gemm_util` at the stand-in; idempotent."""
    if torch.cuda.is_available():
        raise RuntimeError("the CPU stand-in for grouped_gemm is for CUDA-less hosts: install grouped_gemm")
    from megatron.core.transformer.moe import grouped_gemm_util

    stand_in = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=_gmm))
    grouped_gemm_util.grouped_gemm = stand_in
    grouped_gemm_util.ops = stand_in.ops
