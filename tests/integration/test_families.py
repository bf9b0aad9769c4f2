"""Every case, the whole path, at TP=2 (expert TP 2), PP=2, EP=2 and TP=2 × PP=2 × EP=2, on the CPU.

For each layout one spawn of gloo ranks (tests/support/family_ranks.py) takes every case of
`CASES` that the support table's row claims the layout for: Llama, Qwen3 with tied embeddings,
Qwen3-MoE, Mixtral with GroupedMLP experts, DeepSeek-V3, GLM-4.5 and GLM-5 (with its MTP layer).
Each is built tiny in megatron-core with Megatron's own modules, wrapped with `colocate_megatron`
against a transformers engine of the family's own class, and run through 3 colocated steps, each
a train step through Megatron's schedule, a sync, a drop, a rollout in which the engine computes
logits of held-out tokens, and a restore the lifecycle verifies bit-identical (`expert_bias`
included, where the family has one). The tests here judge what the ranks recorded, per case and
layout.

The tolerance (tests/support/tolerance.py). Megatron and transformers compute the same function in
bf16 with other kernels, so the logits differ by rounding: each token's worst |Δlogit| must be
within each side's distance from the function both compute: transformers', measured against an
fp32 copy of its model, and Megatron's, bounded by the rounding through the layers (the final
hidden state's drift, bounded as every layer's input's is). A dense model routes nothing: no
token may be over. An MoE router near a tie can pick another expert in transformers than in Megatron, and a
DSA indexer another key; that token's logits move by far more, and through attention the later
tokens' of its sequence. Both sides record every router's and indexer's choices, with the scores
and inputs they chose from; a sequence is compared only up to its first token routed or indexed
differently, and that first choice apart must be a near-tie by the arithmetic: Megatron's margin
there within 6 standard deviations of what the two sides' bf16 rounding moves it by
(tests/support/rounding.py); so must a later one, where its inputs drifted no further than
rounding makes them. GLM-5 is also compared with every DSA layer on Megatron's keys,
where only routing can differ (`test_glm5_attends_where_megatron_does`).

The bound is tight enough that every mapping mistake the converter could make, injected into the
last sync's weights and run through a fresh engine of the class (no new spawn), breaks it
(`Compared.broken`, `test_a_wrong_mapping_breaks_the_tolerance`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from orchestrator.adapters.megatron.convert import hf_names
from orchestrator.models import SUPPORT
from tests.support import mapping_mistakes as m
from tests.support.family_checks import (
    check_restores,
    check_sync_memory,
    engine_against_megatron,
    megatron_logits,
    merged,
    mistaken,
    spec_of,
)
from tests.support.family_ranks import CASES, CYCLES, LAYOUTS, rank_main
from tests.support.hf_glm5 import agreement, nextn_logits
from tests.support.spawn import spawn_ranks
from tests.support.tolerance import compare, engine_logits

pytestmark = pytest.mark.slow

CLAIMS = {row.family: set(row.layouts) for row in SUPPORT}
NEEDS = {"tp2": {"TP"}, "pp2": {"PP"}, "ep2": {"EP"}, "tp2pp2ep2": {"TP", "PP", "EP"}}  # of a family's claims
# The 4-rank layout oversubscribes a 2-core CI machine (four ranks importing Megatron and
# transformers beside the other worker): it runs on request, `pytest -m ranks4`.
CPU_LAYOUTS = [pytest.param(name, marks=pytest.mark.ranks4) if LAYOUTS[name][3] > 2 else name for name in NEEDS]
SPAWN_S = 60  # a bound per case: measured 1-4 s a case, after 20-40 s of starting the ranks


def _cases(layout: str) -> list[str]:
    return [case for case, (family, _) in CASES.items() if NEEDS[layout] <= CLAIMS[family]]


@pytest.fixture(scope="module", params=CPU_LAYOUTS)
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    name, cases = request.param, _cases(request.param)
    out = tmp_path_factory.mktemp(f"families-{name}")
    world = LAYOUTS[name][3]
    start = time.perf_counter()
    reports = spawn_ranks(rank_main, world, out, args=(name, cases), timeout=240 + SPAWN_S * len(cases))
    seconds = time.perf_counter() - start
    print(f"\n{name}: spawn of {world} ranks, {len(cases)} cases: {seconds:.1f} s")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return {"name": name, "reports": reports, "ranks": ranks}


def _ran(run: dict[str, Any], case: str) -> None:
    if case not in _cases(run["name"]):
        pytest.skip(f"{case} does not claim {', '.join(sorted(NEEDS[run['name']]))} in the support table")


@pytest.mark.parametrize("case", list(CASES))
def test_every_restore_is_verified_bit_identical(layout: dict[str, Any], case: str) -> None:
    _ran(layout, case)
    check_restores(layout, case)


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_serves_megatrons_logits(layout: dict[str, Any], case: str) -> None:
    _ran(layout, case)
    family, options = CASES[case]
    first, spec = layout["reports"][0][case], spec_of(layout, case)
    row = next(r for r in SUPPORT if r.family is family)
    assert spec.family is family and spec.tie_embeddings is options.get("tied", False), "read from Megatron's config"
    assert first["engine_class"] == row.hf_class, "transformers' own class for the family"
    if layout["name"] == "tp2" and "expert TP" in row.layouts:
        assert spec.num_experts, f"{family} claims expert TP, which tp2 checks only for an MoE model"
    names = sorted(layout["ranks"][0][case]["weights"])
    assert set(names) <= set(hf_names(spec)), "the engine serves checkpoint names"
    for version, received in first["received"].items():
        assert received == dict.fromkeys(names, 1), f"version {version}: every checkpoint tensor once"
    largest, peak = check_sync_memory(layout, case)
    for cycle, found in enumerate(engine_against_megatron(layout, case), 1):
        print(f"\n{layout['name']} {case} cycle {cycle}: {found}; largest bucket {largest} B, sync peak extra {peak} B")
        assert found.mean_logit > 0.3, "logits near 0 would hide a wrong mapping"
        assert spec.num_experts or (found.compared == found.tokens and found.routed_apart == 0)
        assert found.ok, f"cycle {cycle}: {found}"
    seconds = max(r[case]["seconds"] for r in layout["reports"])
    print(f"{layout['name']} {case}: {seconds} s on the slowest rank")


@pytest.mark.parametrize("case", list(CASES))
def test_each_tensor_is_gathered_once_and_no_rank_holds_more_than_one_bucket(layout: dict[str, Any], case: str) -> None:
    """The sync's peak extra memory stays within one bucket plus the tensor in flight."""
    _ran(layout, case)
    check_sync_memory(layout, case)
    first = layout["reports"][0][case]
    synced = sum(first["bucket_bytes"]["1"])
    assert synced > max(r[case]["largest_whole"] for r in layout["reports"]) * 2, "a sync of several tensors"


def _gather_mistakes(layout: str) -> list[tuple[str, str, Any]]:
    """(case, what goes wrong, the sync with that mistake) of this layout's gathers."""
    if layout == "pp2":
        mistake = ("layers without their stage's offset", lambda s, _: m.swap(s, "layers.0.", "layers.1."))
    elif layout == "ep2":
        mistake = ("experts in their rank's local order", lambda s, _: m.swap(s, "experts.0.", "experts.2."))
    else:
        mistake = ("fc1 shards concatenated whole", lambda s, _: m.fc1_shards_whole(s))
    return [(case, *mistake) for case in ("qwen3_moe", "mixtral grouped")]


# Glm4MoeConfig reads a missing partial_rotary_factor as 0.5: the mistake must say 1.0.
_FULL_ROTARY = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 1.0}}
_YARN_DROPPED = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
FAMILY_MISTAKES: dict[str, list[tuple[str, str, Any, dict[str, Any]]]] = {  # (case, what, the sync, config keys)
    "tp2": [
        ("deepseek_v3", "kv_b_proj rows not per head", m.kv_b_unheaded, {}),
        ("glm4_moe", "q/k/v biases split ignoring groups", m.qkv_bias_ungrouped, {}),
        ("glm_moe_dsa", "indexer rows mapped by name (rope dims last)", m.indexer_rope_last, {}),
    ],
    "pp2": [
        ("deepseek_v3", "MLA's rope rotated as halves", m.as_is, {"rope_interleave": False}),
        ("glm4_moe", "every dim rotated", m.as_is, _FULL_ROTARY),
        ("mixtral grouped", "GroupedMLP blocks not transposed", lambda s, _: m.grouped_untransposed(s), {}),
    ],
    "ep2": [
        ("deepseek_v3", "YaRN dropped", m.as_is, _YARN_DROPPED),
        ("glm4_moe", "expert_bias dropped", m.bias_dropped, {}),
        ("glm4_moe", "routed scale dropped", m.as_is, {"routed_scaling_factor": 1.0}),
        ("glm_moe_dsa", "indexer rows mapped by name (rope dims last)", m.indexer_rope_last, {}),
    ],
    "tp2pp2ep2": [
        ("deepseek_v3", "expert_bias dropped", m.bias_dropped, {}),
        ("deepseek_v3", "routed scale dropped", m.as_is, {"routed_scaling_factor": 1.0}),
        ("mixtral grouped", "GroupedMLP blocks not transposed", lambda s, _: m.grouped_untransposed(s), {}),
    ],
}


def test_a_wrong_mapping_breaks_the_tolerance(layout: dict[str, Any]) -> None:
    """Otherwise the match above would prove nothing about this layout's gathers, GroupedMLP's
    layout, MLA's rows and RoPE, YaRN, GLM-4.5's biases and partial rotary, the router's bias and
    scale, or GLM-5's indexer rows. The sync as it was passes the same check."""
    mistakes = [(c, w, f, {}) for c, w, f in _gather_mistakes(layout["name"])] + FAMILY_MISTAKES[layout["name"]]
    for case, what, mistake, wrong in mistakes:
        _ran(layout, case)
        found = mistaken(layout, case, mistake, wrong)
        print(f"\n{layout['name']} {case}, {what}: {found}")
        assert found.broken, f"{case}, {what}: {found}"
    for case in {case for case, *_ in mistakes}:
        assert mistaken(layout, case, m.as_is, {}).ok, f"{case}: the sync as it was, through the same path"


def test_glm5_attends_where_megatron_does(layout: dict[str, Any]) -> None:
    """With every DSA layer on the keys Megatron's indexer chose, the last sync's logits match
    within the routing-aware tolerance; transformers' own indexers, on the inputs their own model
    gave them, choose Megatron's keys but for near-ties by the arithmetic; and so does a stage's
    first trained indexer on random queries, which with its rope dims left last would not."""
    case = "glm_moe_dsa"
    _ran(layout, case)
    spec = spec_of(layout, case)
    selections = merged(layout, case, "selections", CYCLES - 1)
    assert sorted(selections) == list(range(spec.num_layers + spec.mtp_num_layers))
    found = mistaken(layout, case, m.as_is, {}, forced=True)
    print(f"\n{layout['name']} {case} on Megatron's keys: {found}")
    assert found.ok and found.compared > 0, found
    from orchestrator.adapters.engines.transformers import TransformersEngine

    engine = TransformersEngine(spec, max_batch=1, max_len=1)
    engine.update_weights(list(layout["ranks"][0][case]["weights"].items()), version=1)
    *_, own = engine_logits(engine.model, layout["ranks"][0][case]["tokens"], selections)
    chose = agreement(own, selections, spec.dsa_index_topk)
    print(f"its own indexers against Megatron's: {chose}")
    assert chose.far == 0, f"only a near-tie may choose other keys: {chose}"
    for one in [r[case]["indexer"] for r in layout["reports"] if r[case].get("indexer")]:
        alike, wrong = one["found"], one["rope_last"]  # a stage's first indexer on 256 random queries
        print(f"one indexer, random inputs: {alike}; rope dims left last: {wrong['differ']} differ, {wrong['far']} far")
        assert alike["far"] == 0, alike
        assert wrong["far"] > 0 and wrong["differ"] > wrong["queries"] // 4, "the check sees the mistake"


def test_glm5_mtp_layer_syncs_as_the_checkpoints_nextn_layer(layout: dict[str, Any], tmp_path: Path) -> None:
    """Left out of the lifecycle's syncs and said so; with `hf_buckets(..., mtp=True)` the
    DeepSeek-V3-style layer N, run as SGLang's NextN draft runs it (`nextn_logits`, on Megatron's
    keys), gives Megatron's MTP logits (of the last cycle), within the routing-aware tolerance: it
    reads the main model's output, so a token is compared up to its sequence's first routing
    near-tie in the main model or the MTP layer. Its indexer, on its own inputs, chooses Megatron's
    keys but for near-ties. With eh_proj's halves swapped, it does not match."""
    case = "glm_moe_dsa"
    _ran(layout, case)
    spec = spec_of(layout, case)
    state = {n: t for rank in layout["ranks"] for n, t in rank[case].get("mtp_state", {}).items()}
    assert sorted(state) == sorted(hf_names(spec, mtp=True))
    assert sorted(layout["ranks"][0][case]["weights"]) == sorted(hf_names(spec)), "the lifecycle's syncs: no MTP"
    notes = [r[case]["left_out"] for r in layout["reports"] if r[case]["left_out"]]  # the last stage's ranks
    assert notes and all("mtp.layers.0 left out" in rank[0] for rank in notes)
    selections, tokens = merged(layout, case, "selections", CYCLES - 1), layout["ranks"][0][case]["tokens"]
    routing = merged(layout, case, "routing", CYCLES - 1)
    megatron = megatron_logits(layout, case, "mtp")[-1]
    layers = spec.num_layers + 1  # the main model's, then the MTP layer
    hf, spread, own, routed = nextn_logits(spec, state, tokens, tmp_path, selections)
    found = compare(megatron, hf, spread, layers, (routing, routed))
    print(f"\n{layout['name']} {case} MTP: {found}")
    assert found.ok and found.compared > 0 and megatron.abs().mean() > 0.3, found
    chose = agreement({spec.num_layers: own[spec.num_layers]}, selections, spec.dsa_index_topk)
    assert chose.far == 0, chose
    swapped, spread, _, routed = nextn_logits(
        spec, m.eh_proj_halves_swapped(state, spec), tokens, tmp_path / "swapped", selections
    )
    broken = compare(megatron, swapped, spread, layers, (routing, routed))
    print(f"eh_proj's halves swapped: {broken}")
    assert broken.broken, broken


def test_every_family_is_a_case_and_the_table_claims_only_what_is_checked() -> None:
    """A family of the support table without a case would claim what no test checks; a claim of
    "expert TP" is checked by "tp2", where an MoE model's experts are TP-sharded."""
    assert {family for family, _ in CASES.values()} == set(CLAIMS)
    for family, claims in CLAIMS.items():
        assert claims <= {"TP", "PP", "EP", "expert TP"}, (family, claims)
        assert "expert TP" not in claims or "TP" in claims, family
