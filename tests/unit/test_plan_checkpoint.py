"""The checkpoint rows of the plan, by hand: what the busiest rank of a stage writes (its model
shard, its optimizer shard) and the checkpoint's bytes in all. Against a real Megatron save:
tests/integration/test_plan_vs_megatron.py."""

from __future__ import annotations

from orchestrator.models import ModelShape
from orchestrator.plan.memory import OptimizerSpec, Parallelism, laid_out_numel, plan
from orchestrator.plan.model import Tensor, total_bytes, total_params
from orchestrator.plan.presets import load_model

# hidden 64, 4 heads of 16: every tensor a multiple of 64 elements, so no alignment padding inside
# a buffer. Per layer: norms 64 + 64, QKV 12 x 16 x 64 = 12288, output projection 4096.
SMALL = dict(hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128, vocab_size=256)
ATTENTION = 64 + 12288 + 4096


def test_a_buffer_is_laid_out_last_param_first_on_64_element_starts() -> None:
    tensors = [Tensor("a", 100), Tensor("b", 10)]
    assert laid_out_numel(tensors, distributed=True) == 64 + 100  # b first, a on the next multiple of 64
    assert laid_out_numel(tensors, distributed=False) == 110


def test_dense_model_shard_and_optimizer_shard_by_hand() -> None:
    """2 layers, untied, final norm frozen: the frozen norm is saved (bf16) but has no optimizer state."""
    m = ModelShape(name="dense", num_layers=2, frozen=("decoder.final_layernorm.weight",), **SMALL)
    layer = ATTENTION + 64 + 2 * 128 * 64 + 64 * 128  # pre-MLP norm, fc1, fc2
    params = 2 * 256 * 64 + 2 * layer + 64  # embedding, output layer, 2 layers, final norm
    trainable = params - 64
    one = plan(m, Parallelism())
    (r,) = one.ranks
    assert r.model_shard == 2 * params == 230_016
    assert r.optimizer_shard == r.stage_optimizer == 12 * trainable == 1_379_328  # fp32 main + 2 moments
    assert one.checkpoint_bytes() == (2 * params, 12 * trainable)
    assert one.checkpoint_written(r) == 2 * params + 12 * trainable

    two = plan(m, Parallelism(dp=2))
    (r,) = two.ranks
    assert trainable % 128 == 0  # the buffer ends on lcm(2, 128) with no padding: each rank holds half
    assert r.optimizer_shard == 12 * trainable // 2
    assert two.checkpoint_written(r) == 2 * params + 12 * trainable // 2 == 919_680
    assert two.checkpoint_bytes() == one.checkpoint_bytes()  # the model once, the optimizer state once
    assert plan(m, Parallelism(), optimizer=OptimizerSpec(adam=False)).ranks[0].optimizer_shard == 4 * trainable


def test_moe_model_shard_and_optimizer_shard_by_hand() -> None:
    """1 MoE layer of 4 experts at DP2 x EP2 (expert DP 1), expert_bias and a 64-element fp32 param."""
    m = ModelShape(
        name="moe",
        num_layers=1,
        moe_layers=(0,),
        num_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        expert_bias=True,
        fp32_param_numel=64,
        **SMALL,
    )
    p = plan(m, Parallelism(dp=2, ep=2))
    (r,) = p.ranks
    dense = 2 * 256 * 64 + ATTENTION + 64 + 4 * 64 + 64  # embedding + output, attention, norms, router
    expert = 2 * 32 * 64 + 64 * 32  # fc1 + fc2 of one expert
    assert dense == 49_600 and dense % 128 == 64  # its buffer ends on 49_664: 24_832 elements a DP rank
    assert r.model_shard == 2 * dense + 2 * 2 * expert + 4 * 4 + 4 * 64  # 2 local experts, fp32 bias and param
    # Dense state: half the padded buffer; the 2 local experts: whole (expert DP 1); the fp32 param:
    # its own buffer of 128, of which rank 0 holds the 64 elements that are the param.
    assert r.optimizer_shard == 12 * (24_832 + 2 * expert + 64)
    assert p.checkpoint_written(r) == 124_048 + 446_208
    model, optimizer = p.checkpoint_bytes()
    assert model == 2 * (dense + 4 * expert) + 4 * 4 + 4 * 64 == 148_624
    # One dense buffer for the stage's DP group, one expert buffer per EP rank, all ranks' state once.
    assert optimizer == 12 * (dense + 4 * expert + 64) == 890_880


def test_the_last_stages_embedding_copy_is_saved_from_the_first_stage() -> None:
    """GLM-5's MTP layer puts a copy of the word embeddings on the last stage: held there, saved once."""
    m = load_model("glm-5")
    p = plan(m, Parallelism(pp=4, pp_layers=(19, 20, 20, 19)))
    assert sum(r.params for r in p.ranks) - total_params(m) == 154_880 * 6144  # the copy, held twice
    assert sum(r.model_shard for r in p.ranks) == p.checkpoint_bytes()[0] == total_bytes(m)  # saved once
