"""What the whole-path tests check of each case, from what `family_ranks` recorded: shared by the
CPU test (tests/integration/test_families.py) and the GPU one (tests/gpu/test_families_gpu.py).

`run` is one spawn's outcome: {"name": layout, "reports": [per rank {case: report}], "ranks":
[per rank {case: tensors}]}.
"""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.adapters.megatron.convert import hf_config
from orchestrator.models import Family, ModelShape
from tests.support.family_ranks import BUCKET_BYTES, CYCLES
from tests.support.tolerance import Compared, compare, engine_logits, own_rounding

__all__ = [
    "check_restores",
    "check_sync_memory",
    "engine_against_megatron",
    "megatron_logits",
    "merged",
    "mistaken",
    "spec_of",
]


def spec_of(run: dict[str, Any], case: str) -> ModelShape:
    """The shape the case's rank recorded (`dataclasses.asdict`, its tuples maybe lists by now)."""
    data = run["reports"][0][case]["spec"]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return ModelShape(**fields | {"family": Family(data["family"])})


def merged(run: dict[str, Any], case: str, key: str, cycle: int) -> dict[int, Any]:
    """`key`'s per-layer records of `cycle` (0-based), from every pipeline stage's source rank."""
    return {layer: t for rank in run["ranks"] for layer, t in rank[case][key][cycle].items()}


def megatron_logits(run: dict[str, Any], case: str, key: str = "megatron") -> list[torch.Tensor]:
    """Per cycle, Megatron's logits (or with `key="mtp"` its MTP layer's) from the last stage."""
    (logits,) = [r[case][key] for r in run["ranks"] if r[case][key][0] is not None]
    return logits


def check_restores(run: dict[str, Any], case: str) -> None:
    """Every restore verified bit-identical, `expert_bias` an extra that moved and came back."""
    for report in (r[case] for r in run["reports"]):
        assert [c["verified"] for c in report["cycles"]] == [True] * CYCLES, report["cycles"]
        assert [c["version"] for c in report["cycles"]] == list(range(1, CYCLES + 1))
        biases = report["expert_bias_sources"]
        # Each expert_bias is an extra: backed up at the pause, copied back at the restore, and
        # in the digests the restore is verified against (the trainer digests params and extras).
        assert set(biases.values()) <= {"extras"} and set(biases) <= set(report["extras"]), biases
        for cycle in report["cycles"]:  # each moved in each step: a bias that never moved proves nothing
            assert cycle["expert_bias_moved"] == cycle["expert_bias_held"] == len(biases), (case, cycle)
    if any(r[case]["expert_bias"] for r in run["reports"]):
        assert any(r[case]["expert_bias_sources"] for r in run["reports"]), "no rank holds an expert_bias"


def engine_against_megatron(run: dict[str, Any], case: str) -> list[Compared]:
    """Per cycle: the engine's logits (as it served them) against Megatron's, routing-aware."""
    spec, engine = spec_of(run, case), run["ranks"][0][case]
    out = []
    for cycle, (ours, theirs) in enumerate(zip(megatron_logits(run, case), engine["engine"], strict=True)):
        routing = (merged(run, case, "routing", cycle), engine["engine_routing"][cycle])
        selections = (merged(run, case, "selections", cycle), engine["engine_keys"][cycle])
        spread, own = engine["engine_spread"][cycle], engine["engine_own"][cycle]
        topk = spec.dsa_index_topk or 0
        out.append(compare(ours, theirs, spread, spec.num_layers, routing, selections, topk, own))
    return out


def check_sync_memory(run: dict[str, Any], case: str) -> tuple[int, int]:
    """Each bucket within the budget, each sharded tensor gathered once, the sync's peak extra
    memory within one bucket plus the tensor in flight; (largest bucket, peak extra) in bytes."""
    first = run["reports"][0][case]
    for version, sizes in first["bucket_bytes"].items():
        assert max(sizes) <= BUCKET_BYTES and len(sizes) > 1, (version, sizes)
    for report in (r[case] for r in run["reports"]):
        # One bucket, plus the tensor in flight: its gathered shards and the whole they become.
        bound = BUCKET_BYTES + 2 * report["largest_whole"]
        for cycle in report["cycles"]:
            assert cycle["peak_extra_bytes"] <= bound, (case, cycle, bound)
            assert cycle["gathers"] == report["sharded"], (case, "each sharded tensor is gathered exactly once")
    largest = max(max(sizes) for sizes in first["bucket_bytes"].values())
    peak = max(c["peak_extra_bytes"] for r in run["reports"] for c in r[case]["cycles"])
    return largest, peak


def mistaken(run: dict[str, Any], case: str, mistake: Any, wrong: dict[str, Any], *, forced: bool = False) -> Compared:
    """The last cycle's served weights through `mistake(state, spec)` into a fresh engine of the
    case's class whose config has the keys `wrong` set, against Megatron's last logits (`forced`:
    each DSA layer on Megatron's keys). `mistake` = `as_is` and no `wrong`: the sync as it was."""
    from orchestrator.adapters.engines.transformers import TransformersEngine

    spec, rank0 = spec_of(run, case), run["ranks"][0][case]
    config = hf_config(spec)
    for key, value in wrong.items():
        setattr(config, key, value)
    engine = TransformersEngine(config, max_batch=1, max_len=1)
    engine.update_weights(list(mistake(rank0["weights"], spec).items()), version=1)
    last = CYCLES - 1
    selections = merged(run, case, "selections", last)
    logits, spread, routing, keys = engine_logits(engine.model, rank0["tokens"], selections if forced else None)
    megatron = megatron_logits(run, case)[last]
    topk = spec.dsa_index_topk or 0
    rounding = None if forced else own_rounding(engine.model, rank0["tokens"], (logits, routing, keys), topk)
    chosen = ({}, {}) if forced else (selections, keys)
    routed = (merged(run, case, "routing", last), routing)
    return compare(megatron, logits, spread, spec.num_layers, routed, chosen, topk, rounding)
