"""Every family, the whole path, at TP=2 (expert TP 2), PP=2, EP=2 and TP=2 × PP=2 × EP=2, on the CPU.

For each layout one spawn of gloo ranks (tests/support/family_ranks.py) takes every family of
`FAMILIES` (the support table's) in turn: builds it tiny in megatron-core with Megatron's own
modules, wraps it with `colocate_megatron` against a transformers engine of the family's own class,
and runs 3 colocated steps, each a train step through Megatron's schedule, a sync, a drop, a
rollout in which the engine computes logits of held-out tokens, and a restore the lifecycle
verifies bit-identical (`expert_bias` included, where the family has one). The tests here judge
what the ranks recorded, per family and layout.

The tolerance. Megatron and transformers compute the same function in bf16, but not with the same
kernels (fused QKV, the order of reductions, where each rounds), so the logits differ by bf16
rounding that grows through the layers: over logits of mean magnitude about 0.8 the measured
worst token of a dense model was 0.11 (docs/conversion.md), so `TOLERANCE` is 0.15 on each
token's largest |Δlogit|, with no dense token allowed over it. An MoE router near a tie can pick
another expert in one than in the other; that token's logits then move by far more, the others'
not at all: an MoE model may have `ROUTING_FLIPS` tokens over it. A wrong mapping or gather moves
nearly every token (`test_a_wrong_gather_breaks_the_tolerance`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from orchestrator.adapters.megatron.convert import Family, ModelSpec, hf_config
from orchestrator.models import SUPPORT
from tests.support.family_ranks import BUCKET_BYTES, CYCLES, LAYOUTS, rank_main
from tests.support.megatron_parallel import FAMILIES
from tests.support.spawn import spawn_ranks

pytestmark = pytest.mark.slow

TOLERANCE = 0.15  # max |Δlogit| of a token (see the module docstring)
ROUTING_FLIPS = 2  # tokens of BATCH x SEQ = 64 an MoE model may have over it, in each cycle
CLAIMS = {row.family: set(row.layouts) for row in SUPPORT}
NEEDS = {"tp2": {"TP"}, "pp2": {"PP"}, "ep2": {"EP"}, "tp2pp2ep2": {"TP", "PP", "EP"}}  # of a family's claims
SPAWN_S = 60  # a bound per family: measured 1-4 s a family, after 30-70 s of starting the ranks


def _families(layout: str) -> list[Family]:
    return [f for f in FAMILIES if NEEDS[layout] <= CLAIMS[f]]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    name = request.param
    families = [f.value for f in _families(name)]
    out = tmp_path_factory.mktemp(f"families-{name}")
    world = LAYOUTS[name][3]
    reports = spawn_ranks(rank_main, world, out, args=(name, families), timeout=240 + SPAWN_S * len(families))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return {"name": name, "reports": reports, "ranks": ranks}


def _ran(layout: dict[str, Any], family: Family) -> None:
    if family not in _families(layout["name"]):
        pytest.skip(f"{family} does not claim {', '.join(sorted(NEEDS[layout['name']]))} in the support table")


def _logits(layout: dict[str, Any], family: Family) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per cycle: Megatron's logits (from the last stage's source rank) and the engine's."""
    ranks = [r[family.value] for r in layout["ranks"]]
    (megatron,) = [r["megatron"] for r in ranks if r["megatron"][0] is not None]
    return megatron, ranks[0]["engine"]


def _over(errors: torch.Tensor) -> int:
    return int((errors.amax(dim=-1) > TOLERANCE).sum())


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_every_restore_is_verified_bit_identical(layout: dict[str, Any], family: Family) -> None:
    _ran(layout, family)
    for report in (r[family.value] for r in layout["reports"]):
        assert [c["verified"] for c in report["cycles"]] == [True] * CYCLES, report["cycles"]
        assert [c["version"] for c in report["cycles"]] == list(range(1, CYCLES + 1))
        biases = report["expert_bias_sources"]
        # Each expert_bias is an extra: backed up at the pause, copied back at the restore, and
        # in the digests the restore is verified against (the trainer digests params and extras).
        assert set(biases.values()) <= {"extras"} and set(biases) <= set(report["extras"]), biases
        for cycle in report["cycles"]:  # each moved in each step: a bias that never moved proves nothing
            assert cycle["expert_bias_moved"] == cycle["expert_bias_held"] == len(biases), (family, cycle)
    if any(r[family.value]["expert_bias"] for r in layout["reports"]):
        assert any(r[family.value]["expert_bias_sources"] for r in layout["reports"]), "no rank holds an expert_bias"


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_the_engine_serves_megatrons_logits(layout: dict[str, Any], family: Family) -> None:
    _ran(layout, family)
    first = layout["reports"][0][family.value]
    spec = ModelSpec.from_dict(first["spec"])
    row = next(r for r in SUPPORT if r.family is family)
    assert first["engine_class"] == row.hf_class, "transformers' own class for the family"
    if layout["name"] == "tp2" and "expert TP" in row.layouts:
        assert spec.num_experts, f"{family} claims expert TP, which tp2 checks only for an MoE model"
    names = sorted(layout["ranks"][0][family.value]["weights"])
    for version, received in first["received"].items():
        assert received == dict.fromkeys(names, 1), f"version {version}: every checkpoint tensor once"
    megatron, engine = _logits(layout, family)
    allowed = ROUTING_FLIPS if spec.num_experts else 0
    for cycle, (ours, theirs) in enumerate(zip(megatron, engine, strict=True), 1):
        diff = (theirs - ours).abs()
        over = _over(diff)
        peak = max(r[family.value]["cycles"][cycle - 1]["peak_extra_bytes"] for r in layout["reports"])
        print(
            f"\n{layout['name']} {family} cycle {cycle}: max |Δlogit| {diff.max():.4f}, mean {diff.mean():.5f}, "
            f"tokens over {TOLERANCE}: {over}/{diff.shape[0] * diff.shape[1]}, mean |logit| {ours.abs().mean():.3f}; "
            f"largest bucket {max(first['bucket_bytes'][str(cycle)])} B, sync peak extra {peak} B"
        )
        assert ours.abs().mean() > 0.3, "logits near 0 would hide a wrong mapping"
        assert over <= allowed, f"cycle {cycle}: {over} tokens over {TOLERANCE}, max {diff.max():.4f}"
    seconds = max(r[family.value]["seconds"] for r in layout["reports"])
    print(f"{layout['name']} {family}: {seconds} s on the slowest rank")


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_each_tensor_is_gathered_once_and_no_rank_holds_more_than_one_bucket(
    layout: dict[str, Any], family: Family
) -> None:
    """The sync's peak extra memory stays within one bucket plus the tensor in flight."""
    _ran(layout, family)
    first = layout["reports"][0][family.value]
    for version, sizes in first["bucket_bytes"].items():
        assert max(sizes) <= BUCKET_BYTES and len(sizes) > 1, (version, sizes)
    for report in (r[family.value] for r in layout["reports"]):
        # One bucket, plus the tensor in flight: its gathered shards and the whole they become.
        bound = BUCKET_BYTES + 2 * report["largest_whole"]
        for cycle in report["cycles"]:
            assert cycle["peak_extra_bytes"] <= bound, (family, cycle, bound)
            assert cycle["gathers"] == report["sharded"], "each sharded tensor is gathered exactly once"
    synced = sum(first["bucket_bytes"]["1"])
    assert synced > BUCKET_BYTES + 2 * max(r[family.value]["largest_whole"] for r in layout["reports"]), (
        "a sync that held the whole model at once would stay within the bound: it would prove nothing"
    )


def _swap(state: dict[str, torch.Tensor], a: str, b: str) -> dict[str, torch.Tensor]:
    """`state` with every name holding `a` and the same name holding `b` exchanged."""
    out = dict(state)
    for name in state:
        if a in name and name.replace(a, b) in state:
            out[name], out[name.replace(a, b)] = state[name.replace(a, b)], state[name]
    return out


def _fc1_shards_whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TP=2 mistake: fc1's shards concatenated as they are, each a [gate; up] of its own."""
    out = dict(state)
    for name in state:
        if name.endswith("gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            (g0, g1), (u0, u1) = state[name].chunk(2), state[up].chunk(2)
            out[name], out[up] = torch.cat([g0, u0]), torch.cat([g1, u1])
    return out


MISTAKES = {  # layout: (what goes wrong, the sync with that mistake)
    "tp2": ("fc1 shards concatenated whole", _fc1_shards_whole),
    "pp2": ("layers without their stage's offset", lambda s: _swap(s, "layers.0.", "layers.1.")),
    "ep2": ("experts in their rank's local order", lambda s: _swap(s, "experts.0.", "experts.2.")),
    "tp2pp2ep2": ("fc1 shards concatenated whole", _fc1_shards_whole),
}


def _broken(layout: dict[str, Any], family: Family, mistake: Any, **wrong: Any) -> tuple[int, torch.Tensor]:
    """Tokens over the tolerance, and |Δlogit|, when the engine's last sync of `family` goes through
    `mistake(state)` into a fresh engine of its class whose config has the keys `wrong` set."""
    from orchestrator.adapters.engines.transformers import TransformersEngine

    config = hf_config(ModelSpec.from_dict(layout["reports"][0][family.value]["spec"]))
    for key, value in wrong.items():
        setattr(config, key, value)
    rank0 = layout["ranks"][0][family.value]
    engine = TransformersEngine(config, max_batch=1)
    engine.update_weights(list(mistake(rank0["weights"]).items()), version=1)
    megatron, _ = _logits(layout, family)
    diff = (engine.logits(rank0["tokens"]) - megatron[-1]).abs()
    return _over(diff), diff


def test_a_wrong_gather_breaks_the_tolerance(layout: dict[str, Any]) -> None:
    """Otherwise the match above would prove nothing about this layout's gathers: Qwen3-MoE with
    the layout's classic mistake."""
    family = Family.QWEN3_MOE
    _ran(layout, family)
    what, mistake = MISTAKES[layout["name"]]
    broken, diff = _broken(layout, family, mistake)
    print(f"\n{layout['name']} {what}: {broken}/{diff.shape[0] * diff.shape[1]} tokens over {TOLERANCE}")
    assert broken > 4 * ROUTING_FLIPS, f"{what}: only {broken} tokens over {TOLERANCE}, max {diff.max():.4f}"


def test_the_support_table_claims_only_what_these_layouts_check() -> None:
    """A claim of "expert TP" is checked by "tp2", where an MoE model's experts are TP-sharded
    (`test_the_engine_serves_megatrons_logits` checks the family is MoE)."""
    for family, claims in CLAIMS.items():
        assert claims <= {"TP", "PP", "EP", "expert TP"}, (family, claims)
        assert "expert TP" not in claims or "TP" in claims, family
