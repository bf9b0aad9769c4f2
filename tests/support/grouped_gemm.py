"""A stand-in for the `grouped_gemm` package's one op that Megatron's GroupedMLP calls, where the
package is not installed (the CPU CI, and the GPU machine too).

megatron-core builds the local spec's experts under `moe_grouped_gemm=True` as `GroupedMLP`, which
asserts that the `grouped_gemm` package (CUDA kernels, fanshiqing/grouped_gemm) imports and calls
`grouped_gemm.ops.gmm` in its forward. Where it does not import, this replaces that op alone, with
its definition: `gmm(a, b, batch_sizes)` multiplies the i-th run of `batch_sizes[i]` rows of `a` by
`b[i]` (by `b[i]ᵀ` with `trans_b`), on whatever device `a` is. Everything else, GroupedMLP's params,
their views per expert, its activation and the dispatch around it, is Megatron's own. Where the
package is installed, it is used and nothing is replaced.
"""

from __future__ import annotations

import types

import torch

__all__ = ["stand_in_where_missing"]


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    runs = a.split(batch_sizes.tolist())
    return torch.cat([run @ (w.t() if trans_b else w) for run, w in zip(runs, b, strict=True)])


def stand_in_where_missing() -> bool:
    """Point Megatron's `grouped_gemm_util` at the stand-in unless the package imports; idempotent.
    Whether the stand-in is in use. megatron-core 0.19 has no legacy GroupedMLP (its local spec
    builds SequentialMLP under `moe_grouped_gemm`), so nothing there calls the op."""
    try:
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:
        return False

    if grouped_gemm_util.grouped_gemm is not None and grouped_gemm_util.ops is not _STAND_IN.ops:
        return False
    grouped_gemm_util.grouped_gemm = _STAND_IN
    grouped_gemm_util.ops = _STAND_IN.ops
    return True


_STAND_IN = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=_gmm))
