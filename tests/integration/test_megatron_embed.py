"""The one-call embedding and the read-only sync, on real megatron-core (gloo, CPU) and a real
transformers engine, each scenario in a spawned rank process (tests/support/embed_ranks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from orchestrator.models import support_table
from states import Phase
from tests.support.embed_ranks import rank_main
from tests.support.spawn import spawn_ranks

pytestmark = pytest.mark.slow


def run(scenario: str, out: Path) -> dict[str, Any]:
    (result,) = spawn_ranks(rank_main, 1, out, args=(scenario,))
    return result


@pytest.fixture(scope="module")
def embed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run("embed", tmp_path_factory.mktemp("embed"))


def test_a_transport_writing_to_the_extras_it_reads_leaves_the_next_restore_bit_identical(tmp_path: Path) -> None:
    result = run("extras_written", tmp_path)
    assert result["is_trainer"], "MegatronTrainer implements the Trainer Protocol, sync_tensors included"
    for cycle in result["cycles"]:
        # expert_bias, the fp32 param and the frozen norm: every kind of extra was written to
        assert len(cycle["written"]) == 3, cycle["written"]
        assert cycle["bit_identical"], cycle["reason"]


def test_one_call_syncs_drops_and_restores_bit_identically(embed: dict[str, Any]) -> None:
    assert embed["regions"] == ("TorchMemorySaverRegions" if torch.cuda.is_available() else "StorageRegions")
    assert embed["tracing_provider"] == "ProxyTracerProvider"  # no OTEL_* set: the global provider
    assert [c["version"] for c in embed["cycles"]] == [1, 2]
    assert all(c["engine_has_trainer_weights"] for c in embed["cycles"]), embed["cycles"]
    assert [c["verified"] for c in embed["cycles"]] == [True, True]
    assert embed["backup"] == {"verified": True, "mode": "backup"}


def test_the_flat_keywords_of_the_release_before_still_work_and_warn_naming_their_group(
    embed: dict[str, Any],
) -> None:
    deprecated = embed["deprecated"]
    assert deprecated["warnings"] == [
        ["DeprecationWarning", "verify_cycles= is deprecated: pass verify=Verify(cycles=...)", "embed_ranks.py"],
        ["DeprecationWarning", "bucket_bytes= is deprecated: pass sync=Sync(bucket_bytes=...)", "embed_ranks.py"],
        ["DeprecationWarning", "offload= is deprecated: pass memory=Memory(offload=...)", "embed_ranks.py"],
    ]  # each once, at the caller's line
    assert deprecated["taken"] == [1, 1 << 16, "always"]
    assert deprecated["version"] == 1 and deprecated["verified"] is True


def test_setup_is_read_from_megatrons_configs_not_taken_on_trust(embed: dict[str, Any]) -> None:
    assert "overlap-param-gather" in embed["overlap_param_gather"], embed["overlap_param_gather"]
    assert "distributed_optimizer: read from Megatron's DDP and optimizer configs" in embed["megatron_flag"]
    assert "colocated: not a TrainingSetup flag" in embed["unknown_flag"]


def test_what_the_one_call_refuses_is_named_and_leaves_the_engine_untouched(embed: dict[str, Any]) -> None:
    assert "mode must be one of" in embed["bad_mode"] and "'rematerialise'" in embed["bad_mode"]
    assert "'no-update-weights' has no update_weights" in embed["no_update_weights"]
    # Sigmoid-routed experts make the default conversion read the model as GLM-4.5, which it is
    # not: refused by its config, once (not per expert tensor), naming the difference.
    assert "1 configuration problem(s)" in embed["moe"], embed["moe"]
    assert "no HF glm4_moe equivalent: shared experts of ffn 0" in embed["moe"], embed["moe"]
    assert f"colocate converts to\n{support_table()}" in embed["moe"], "the refusal names what it does convert"
    assert "decoder.layers.1.mlp.router.expert_bias: not rebuilt from the fp32 mains" in embed["uncovered"]
    for problem in ("normalization='LayerNorm'", "rotary_interleaved=True"):
        assert problem in embed["not_llama"], embed["not_llama"]
    # The served config, read as the planner reads it, builds another RoPE: it would load cleanly.
    assert "rope_theta is 500000.0 there, 10000.0 in the trainer's model" in embed["served_other"], embed
    assert "served_config '/nowhere': not a readable JSON config" in embed["served_missing"]
    assert embed["engine_untouched"]


def test_a_converter_that_writes_to_a_live_param_faults_the_update_naming_it(embed: dict[str, Any]) -> None:
    written = embed["written"]
    assert written["cause"] == "SyncTensorWritten" and written["names"] == ["embedding.word_embeddings.weight"]
    assert "read-only" in written["message"]
    assert written["phase"] == embed["faulted"]
    assert written["engine_version"] is None, "the engine serves no version of a failed update"


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Per layout ("tp2", "pp2"), the two gloo ranks' results; one spawn runs both layouts."""
    from tests.support.embed_parallel_ranks import rank_main as parallel_rank

    ranks = spawn_ranks(parallel_rank, 2, tmp_path_factory.mktemp("embed-parallel"))
    return {layout: [rank[layout] for rank in ranks] for layout in ranks[0]}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_one_call_at_tp2_and_pp2_syncs_the_gathered_model_once(
    parallel: dict[str, list[dict[str, Any]]], layout: str
) -> None:
    """Two gloo ranks through `colocate_megatron` with its default converter, one engine for both:
    after every sync the engine holds exactly the trainer's params gathered and converted to HF,
    each HF tensor arrived once, and only the sync sources sent."""
    first, second = parallel[layout]
    versions = [1, 2, 3] if layout == "tp2" else [1, 2]  # tp2: the third after a recovery
    for rank in (first, second):
        assert [c["version"] for c in rank["cycles"]] == versions
        assert [c["verified"] for c in rank["cycles"]][:2] == [True, True]  # verify_cycles=2
    for cycle in first["cycles"]:
        assert cycle["engine_equals_trainer"], cycle["differ"]
    params = first["engine_params"]
    for version in versions:
        assert first["received"][str(version)] == dict.fromkeys(params, 1), first["received"][str(version)]
    if layout == "tp2":  # TP rank 1 joins every gather and sends nothing
        assert (first["source"], second["source"]) == (True, False)
        assert second["sent"] == 0
    else:  # each pipeline stage is a source and sends its own layers
        assert (first["source"], second["source"]) == (True, True)
        stage_1 = [n for n in params if n.startswith(("model.layers.1.", "model.norm.", "lm_head."))]
        assert second["sent"] == 2 * len(stage_1), second["sent"]


def test_a_send_that_fails_on_one_rank_faults_the_update_on_every_rank(
    parallel: dict[str, list[dict[str, Any]]],
) -> None:
    """TP=2: the engine refuses the source's first bucket. TP rank 1 joins the rest of the gathers,
    learns of the failure in the closing all-reduce, and faults too; nobody hangs. Both recover
    and the next update syncs the whole model (the previous test checks that cycle)."""
    first, second = (rank["failed"] for rank in parallel["tp2"])
    assert first["cause"] == "EngineError" and "injected" in first["message"], first
    assert second["cause"] == "PeerPushFailed" and "another rank" in second["message"], second
    for failed in (first, second):
        assert (failed["phase"], failed["recovered"]) == (Phase.FAULTED.value, Phase.TRAIN.value), failed
        assert failed["engine_version"] == 2, "the engine serves the last complete version"


def test_calls_that_took_effect_and_then_raised_are_reconciled_on_real_megatron(embed: dict[str, Any]) -> None:
    """Issue 24's repros A–E through colocate_megatron: after each, recover leaves nothing paused,
    the engine holding nothing and every param cast(its fp32 main) by Megatron's own range map,
    and the next cycle syncs the trainer's weights into the engine."""
    result = embed["after_effect"]
    assert result["first"]["engine_has_trainer_weights"]
    for name in ("A: a region resume", "B: a region pause", "C: an engine release", "D: an engine resume"):
        assert (
            result[name]["raised"]
            == "Timeout: "
            + {"A": "resume", "B": "pause", "C": "release", "D": "resume"}[name[0]]
            + ": no answer (it took effect)"
        ), result[name]
    assert result["E: an optimizer step"]["raised"] == "Timeout: injected: the cast after the inner step"
    for name, after in result.items():
        if name == "first":
            continue
        assert after["phase"] == Phase.TRAIN.value and after["paused"] == [], (name, after)
        assert after["engine_released"] == ["cuda_graph", "kv_cache", "weights"], (name, after)
        assert after["params_off_their_mains"] == [], (name, after)
        assert after["engine_has_trainer_weights"], (name, after)
