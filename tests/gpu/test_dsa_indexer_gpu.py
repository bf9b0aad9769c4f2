"""GLM-5's DSA indexer on a GPU, with the megatron-core a GPU machine runs: what CPU CI cannot.

CPU CI runs megatron-core 0.16.1 (0.17 and later need Python 3.12), whose indexer keeps each
head's rope dims last; from 0.19 they come first, as in transformers, and the config says whether
they interleave (`dsa_indexer_rope_interleaved`). The converter maps the rows for whichever it
reads (`dsa.megatron_fields`). Here, on CUDA in bf16, Megatron's own `DSAIndexer` (built from
`get_dsa_module_spec_for_backend`'s spec) and transformers' `GlmMoeDsaIndexer` loaded with the
converted weights choose the same keys but for near-ties by the arithmetic, and the other layout
would not.

Neither Transformer Engine nor `fast_hadamard_transform` is installed there either: the indexer's
replicated linears and its Hadamard rotation are the seams of `orchestrator/adapters/megatron/specs.py`.
Where `fast_hadamard_transform` is installed, the last test checks that seam against it, to the
rounding two fp32 butterfly orders and one bf16 rounding each allow (`hadamard_bound`; run once on
an H200, the kernel compiled from its source for sm_90: bit-identical in bf16, and the indexer
test gave the same choices with the kernel as with the seam).
"""

from __future__ import annotations

import json
import math
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.spawn import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SEQ, BATCH = 64, 4


def _indexer_rank(rank: int, world: int, port: int, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        import megatron.core
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.transformer.spec_utils import build_module

        from orchestrator.models import Family
        from tests.support.hf_glm5 import compare_selections, indexer_selections
        from tests.support.megatron_dsa import dsa_attention_spec, enable_dsa_without_extensions
        from tests.support.megatron_parallel import parallel_config

        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        ps.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        config = parallel_config(Family.GLM_MOE_DSA, 1, 1, 1)
        enable_dsa_without_extensions()
        indexer = build_module(dsa_attention_spec(config).submodules.indexer, config=config).cuda().bfloat16()
        found, rope_last = compare_selections(indexer_selections(indexer, config, SEQ, BATCH), config.dsa_indexer_topk)
        result = {
            "megatron": megatron.core.__version__,
            "rope_first": hasattr(config, "dsa_indexer_rope_interleaved"),
            "found": found.__dict__,
            "rope_last": rope_last.__dict__,
        }
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    except BaseException:
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def test_megatron_and_hf_indexers_select_the_same_keys_on_cuda(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers.models.glm_moe_dsa")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    (result,) = spawn_ranks(_indexer_rank, 1, tmp_path, timeout=300)
    found, rope_last = result["found"], result["rope_last"]
    print(f"\nmegatron-core {result['megatron']} (rope dims first: {result['rope_first']}): {found}")
    print(f"rope dims in the other place: {rope_last['differ']}/{rope_last['queries']} choose otherwise")
    # Only near-ties by the arithmetic choose apart (tests/support/rounding.py, on the same
    # inputs); the other layout chooses apart where rounding does not reach.
    assert found["far"] == 0, found
    assert rope_last["far"] > 0 and rope_last["differ"] > rope_last["queries"] // 4


def hadamard_bound(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """How far apart two bf16 results `a`, `b` of `H x * scale` (H: the Hadamard matrix of the last
    dim d) may be, each computed in fp32 by some order of butterflies and rounded once to bf16.

    In fp32 (unit roundoff 2^-24) an output is a signed sum of the d inputs through log2(d) levels
    of additions, times the scale: log2(d) + 1 roundings, so each side is within
    (log2(d) + 1) 2^-24 scale sum|x| of the exact value (Higham's bound for a summation tree), and
    the two within twice that. Then each rounds to bf16, to nearest: half a bf16 ulp each, one ulp
    of the larger of |a|, |b| together (bf16 keeps 8 significant bits: an ulp is 2^-7 of a value's
    power of two, at most 2^-7 |v|). The fp32 term is the floor for outputs near 0, whose own ulp is
    tiny; elsewhere it is under 2^-9 of an ulp (d = 128, x ~ 3 N(0, 1): 2.6e-5 against the 2^-6 of
    a typical |output|, 2.4), so the bound is 1 ulp."""
    d = x.shape[-1]
    fp32 = 2 * (math.log2(d) + 1) * 2.0**-24 * scale * x.float().abs().sum(-1, keepdim=True)
    larger = torch.maximum(a.float().abs(), b.float().abs())
    ulp = torch.where(larger > 0, torch.exp2(torch.floor(torch.log2(larger)) - 7), 0.0)
    return ulp + fp32


def test_the_hadamard_seam_is_fast_hadamard_transform() -> None:
    fast = pytest.importorskip("fast_hadamard_transform")
    from tests.support.megatron_dsa import walsh_hadamard

    for dim in (32, 128):  # this test's indexer heads, GLM-5's
        x = (torch.randn(64, 4, 32, dim, device="cuda") * 3).bfloat16()
        scale = dim**-0.5
        seam, kernel = walsh_hadamard(x, scale), fast.hadamard_transform(x, scale=scale)
        # Measured on an H200 (the kernel built from its source for sm_90): bit-identical; the
        # butterfly order may differ elsewhere, so each element may be 1 bf16 ulp apart.
        apart, bound = (seam.float() - kernel.float()).abs(), hadamard_bound(x, seam, kernel, scale)
        assert (apart <= bound).all(), f"d={dim}: {int((apart > bound).sum())} outputs over, {apart.max()}"
        # A wrong transform moves outputs by a share of themselves, not by an ulp: a scale off by
        # 2^-5 (3%: 4 to 8 ulps) is outside the bound at all but the outputs nearest 0.
        off = walsh_hadamard(x, scale * (1 + 2**-5))
        assert ((off.float() - kernel.float()).abs() > hadamard_bound(x, off, kernel, scale)).float().mean() > 0.99
