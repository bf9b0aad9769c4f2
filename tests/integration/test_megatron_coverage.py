"""Issue 10 items 6-8 on real megatron-core (gloo, CPU), built as Megatron builds it: the router's
buffers left as Float16Module casts them, the first stash before any forward, EP=2 at world size 2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.support.megatron_ranks import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks("coverage", 2, tmp_path_factory.mktemp("coverage"), ep=2)


def test_an_fp32_param_or_expert_bias_left_out_is_refused_at_init_by_name(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["without_fp32"] is not None and "fp32_output_scale: not rebuilt" in rank["without_fp32"]
        refused = rank["without_expert_bias"]
        assert refused is not None and "decoder.layers.1.mlp.router.expert_bias: not rebuilt" in refused


def test_expert_bias_restores_bit_identically_after_a_cold_start(ranks: list[dict]) -> None:
    for rank in ranks:
        assert [c["bit_identical"] for c in rank["cycles"]] == [True] * 5, [c["reason"] for c in rank["cycles"]]
        assert rank["expert_bias"] == {"live": "torch.float32", "backup": "torch.float32"}


def test_sync_names_carry_global_expert_indices_under_ep(ranks: list[dict]) -> None:
    experts = [{n for n in rank["sync_names"] if ".local_experts." in n} for rank in ranks]
    assert experts[0] and experts[1] and not experts[0] & experts[1], "each rank names its own experts"
    indices = {n.split(".local_experts.")[1].split(".")[0] for names in experts for n in names}
    assert indices == {"0", "1"}


def test_a_stash_refuses_a_backup_whose_dtype_is_no_longer_the_live_one(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["recast"] == (
            "extra decoder.layers.1.mlp.router.expert_bias: its backup is torch.float32 [2], "
            "the live tensor torch.bfloat16 [2]"
        )
