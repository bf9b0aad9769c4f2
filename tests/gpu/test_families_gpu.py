"""Every case of the whole-path test on one CUDA device: what the CPU test
(tests/integration/test_families.py) cannot show, with the megatron-core a GPU machine runs
(0.19.2 where it was written for).

World size 1 (nccl), each case of `family_ranks.CASES` built on CUDA by the same rank code
(`rank_main(..., device="cuda")`): Megatron's own modules initialized on the device, no CPU path.
`colocate_megatron` takes its default regions there (torch_memory_saver), the engine is a
`TransformersEngine` on the same device, and each case runs 3 colocated steps whose restores the
lifecycle verifies bit-identical; the engine's logits are judged with the CPU test's tolerance
(tests/support/tolerance.py, routing- and index-aware).

Stand-ins only where the GPU machine lacks the package too: `grouped_gemm` is not installed there
(GroupedMLP's `gmm` op: tests/support/grouped_gemm.py), nor `fast_hadamard_transform` or
Transformer Engine (GLM-5's DSA: the seams of orchestrator/adapters/megatron/specs.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.spawn import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.support.family_ranks import CASES, rank_main

    out = tmp_path_factory.mktemp("families-gpu")
    start = time.perf_counter()
    cases = list(CASES)
    reports = spawn_ranks(rank_main, 1, out, args=("one", cases, "cuda"), timeout=600)
    print(f"\none GPU, {len(cases)} cases: {time.perf_counter() - start:.1f} s")
    return {"name": "one", "reports": reports, "ranks": [torch.load(Path(out) / "rank0.pt", weights_only=False)]}


def _cases() -> list[str]:
    from tests.support.family_ranks import CASES

    return list(CASES)


# GLM-5's DSA layers are built as the installed megatron-core builds them
# (`orchestrator.adapters.megatron.specs`): on 0.19 through its experimental-attention-variant spec
# (`AbsorbedMLASelfAttention` around `DSAttention`), on 0.16 inside the MLA spec.
# On the GPU both sides run other kernels than on the CPU (cuBLAS's bf16 GEMMs, the engine's fused
# sdpa against Megatron's unfused attention), but the same bf16: the tolerance is the CPU test's,
# derived from its rounding (tests/support/rounding.py), not from what one device printed. The
# mistakes are the CPU test's to inject.
def _records_selections() -> bool:
    """Whether this megatron-core's DSAttention selects through `DSAIndexer.forward_with_scores`
    (0.16), where the test records the keys Megatron chose."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    return "forward_with_scores" in (dsa.DSAttention.forward.__code__.co_names or ())


@pytest.mark.parametrize("case", _cases())
def test_each_case_on_cuda(run: dict[str, Any], case: str) -> None:
    from tests.support.family_checks import check_restores, check_sync_memory, engine_against_megatron, mistaken
    from tests.support.mapping_mistakes import as_is

    check_restores(run, case)
    largest, peak = check_sync_memory(run, case)
    if case == "glm_moe_dsa" and not _records_selections():
        pytest.skip(
            "built, trained and restored bit-identical on this megatron-core; the engine comparison needs "
            "Megatron's selected keys, which tests/support/megatron_dsa.py records at DSAIndexer.forward_with_scores, "
            "and 0.19's DSAttention selects through forward_before_topk and its own top-k instead"
        )
    for cycle, found in enumerate(engine_against_megatron(run, case), 1):
        print(f"\none {case} cycle {cycle}: {found}; largest bucket {largest} B, sync peak extra {peak} B")
        assert found.mean_logit > 0.3, "logits near 0 would hide a wrong mapping"
        assert found.ok, f"cycle {cycle}: {found}"
    if case == "glm_moe_dsa":
        forced = mistaken(run, case, as_is, {}, forced=True)
        print(f"on Megatron's keys: {forced}")
        assert forced.ok, forced
