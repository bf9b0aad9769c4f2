"""The plan against real megatron-core ranks (gloo, CPU), buffer by buffer, to the byte.

The model is the `cpu` benchmark model of orchestrator/job/presets.py (4 layers, the last MoE with
expert_bias, an fp32 param, a frozen norm), built by `megatron_build.build_gpt` in DDP +
DistributedOptimizer after one Adam step, at DP=1, DP=2 and DP=2 with EP=2. And an MLA GPT of
Megatron's local layer spec at TP2, tensor by tensor (the TE spec needs Transformer Engine). And
the checkpoint rows against a real `dist_checkpointing.save` of the `cpu` model, at DP=1 and at
DP=2 with EP=2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from benchmarks.plan_vs_measured import measure, planned, rows
from tests.support.spawn import context

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (2, 2)], ids=lambda p: f"dp{p[0]}-ep{p[1]}")
def measured(request: pytest.FixtureRequest) -> tuple[int, int, list[dict[str, Any]]]:
    dp, ep = request.param
    return dp, ep, measure("cpu", [dp], ep, start_method=context().get_start_method())["runs"][str(dp)]


def test_every_buffer_is_planned_to_the_byte(measured: tuple[int, int, list[dict[str, Any]]]) -> None:
    dp, ep, ranks = measured
    p = planned("cpu", dp, ep)
    for got in ranks:
        table = rows(p, got)
        assert [name for name, _, _ in table][:6] == [
            "bf16 + fp32 param buffers",
            "grad buffers (fp32)",
            "fp32 mains",
            "Adam moments",
            "extras (pinned, rematerialize)",
            "pinned backup (backup mode)",
        ]
        assert {name: have for name, _, have in table} == {name: want for name, want, _ in table}
        assert got["identical_rematerialize"] and got["identical_backup"]


def test_the_local_spec_splits_mlas_down_projections_as_megatron_does(tmp_path: Path) -> None:
    """`--spec local` against Megatron's own local layer spec at TP2 (tests/support/plan_spec_ranks.py
    names the two parameter-free seams it replaces): every tensor of every rank, by name."""
    from orchestrator.models import ModelShape
    from orchestrator.plan.model import LayerSpec, stage_tensors
    from tests.support.plan_spec_ranks import SHAPE, VOCAB, rank
    from tests.support.spawn import spawn_ranks

    spec = ModelShape(
        name="mla",
        hidden_size=SHAPE["hidden_size"],
        num_layers=SHAPE["num_layers"],
        vocab_size=VOCAB,
        num_attention_heads=SHAPE["num_attention_heads"],
        num_query_groups=SHAPE["num_attention_heads"],
        ffn_hidden_size=SHAPE["ffn_hidden_size"],
        q_lora_rank=SHAPE["q_lora_rank"],
        kv_lora_rank=SHAPE["kv_lora_rank"],
        qk_nope_head_dim=SHAPE["qk_head_dim"],
        qk_rope_head_dim=SHAPE["qk_pos_emb_head_dim"],
        v_head_dim=SHAPE["v_head_dim"],
    )
    planned = stage_tensors(spec, range(2), first=True, last=True, tp=2, ep=1, etp=1, spec=LayerSpec.LOCAL)
    for got in spawn_ranks(rank, 2, tmp_path):
        assert got["params"] == {t.name: t.numel for t in planned}


@pytest.mark.parametrize(("dp", "ep"), [(1, 1), (2, 2)], ids=["dp1", "dp2-ep2"])
def test_the_checkpoint_is_planned_to_the_tensor_byte(tmp_path: Path, dp: int, ep: int) -> None:
    """Each rank saves the model and its optimizer shard as colocate does (torch_dist,
    `dp_reshardable`) after one Adam step. The tensors the checkpoint's metadata lists are the
    planned bytes exactly: the model once, every optimizer shard with its alignment padding.
    The `.distcp` files hold a little more: torch's checkpoint writer frames every tensor as a
    `torch.save` archive of its own (~1.5 KiB each; ~160 of them here) and pickles the non-tensor
    state (param groups, bucket sizes), about 0.07 % of this model; the bound allows 64 KiB + 2 %."""
    from tests.support.plan_checkpoint_ranks import rank
    from tests.support.spawn import spawn_ranks

    p = planned("cpu", dp, ep)
    (stage,) = p.ranks
    model, optimizer = p.checkpoint_bytes()
    got = spawn_ranks(rank, dp, tmp_path, args=(ep,))
    assert (got[0]["model_tensors"], got[0]["optimizer_tensors"]) == (model, optimizer)
    assert model + optimizer <= got[0]["all_distcp"] <= (model + optimizer) * 1.02 + 64 * 2**10
    # Rank 0 saves the model's shard and its optimizer shard: the most a rank writes.
    written = p.checkpoint_written(stage)
    assert written <= got[0]["distcp"] <= written * 1.02 + 64 * 2**10
    assert all(r["distcp"] <= got[0]["distcp"] for r in got)
