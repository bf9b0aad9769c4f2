"""GLM-5's DSA indexer on a GPU, with the megatron-core a GPU machine runs: what CPU CI cannot.

CPU CI runs megatron-core 0.16.1 (0.17 and later need Python 3.12), whose indexer keeps each
head's rope dims last; from 0.19 they come first, as in transformers, and the config says whether
they interleave (`dsa_indexer_rope_interleaved`). The converter maps the rows for whichever it
reads (`dsa.megatron_fields`). Here, on CUDA in bf16, Megatron's own `DSAIndexer` (built from
`get_dsa_module_spec_for_backend`'s spec) and transformers' `GlmMoeDsaIndexer` loaded with the
converted weights choose the same keys but for near-ties, and the other layout would not.

Neither Transformer Engine nor `fast_hadamard_transform` is installed there either: the indexer's
replicated linears and its Hadamard rotation are the seams of `tests/support/megatron_dsa.py`.
Where `fast_hadamard_transform` is installed, the last test checks that seam against it (run once
on an H200, the kernel compiled from its source for sm_90: bit-identical in bf16, and the indexer
test gave the same choices with the kernel as with the seam).
"""

from __future__ import annotations

import json
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
    from tests.support.hf_glm5 import NEAR_TIE

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    (result,) = spawn_ranks(_indexer_rank, 1, tmp_path, timeout=300)
    found, rope_last = result["found"], result["rope_last"]
    print(f"\nmegatron-core {result['megatron']} (rope dims first: {result['rope_first']}): {found}")
    print(f"rope dims in the other place: {rope_last['differ']}/{rope_last['queries']} choose otherwise")
    assert found["differ"] <= found["queries"] // 20 and max(found["gaps"], default=0.0) < NEAR_TIE
    assert rope_last["differ"] > rope_last["queries"] // 4


def test_the_hadamard_seam_is_fast_hadamard_transform() -> None:
    fast = pytest.importorskip("fast_hadamard_transform")
    from tests.support.megatron_dsa import walsh_hadamard

    for dim in (32, 128):  # this test's indexer heads, GLM-5's
        x = (torch.randn(64, 4, 32, dim, device="cuda") * 3).bfloat16()
        # Measured on an H200 (the kernel built from its source for sm_90): bit-identical.
        assert torch.equal(walsh_hadamard(x, dim**-0.5), fast.hadamard_transform(x, scale=dim**-0.5))
