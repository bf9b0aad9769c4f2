"""The offload choice: what `auto`, `always` and `never` keep, the lifecycle skipping what is kept,
the memory guard holding the run to the choice, and `colocate plan --offload`."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from guards.memory import device_free, memory_fits, sleep_need
from orchestrator import ConfigError, GuardRejected
from orchestrator.cli.app import app
from orchestrator.core.offload import choose
from orchestrator.job.job import RunConfig
from orchestrator.plan.memory import EngineSpec, Parallelism, plan
from orchestrator.plan.offload import prices
from orchestrator.plan.presets import load_model
from states import EngineMemory, MemoryBudget, Offload, Phase, Region
from tests.support.rig import cycle, make_rig
from tests.support.snapshots import snap

REGIONS = {Region.PARAM_BUFFER: 200, Region.GRAD_BUFFER: 400, Region.DEFAULT: 1200}
ENGINE = {EngineMemory.WEIGHTS: 300, EngineMemory.KV_CACHE: 1000, EngineMemory.CUDA_GRAPH: 50}
BOTH = frozenset({Region.GRAD_BUFFER, Region.DEFAULT})
# What the sleep needs beyond what is free at TRAIN (engine 1350 in all), per kept set:
# nothing kept -450; default kept 750; grad_buffer kept -50; both kept 1150.


def budget(free: int, **engine: int) -> MemoryBudget:
    engines = ENGINE | {EngineMemory(tag): n for tag, n in engine.items()}
    return MemoryBudget(device_free=free, regions=REGIONS, engine=engines, source="cuda:0")


def test_sleep_need_counts_both_peaks_beside_what_stays() -> None:
    needs = {keep: sleep_need(budget(0), keep) for keep in (frozenset(), frozenset({Region.DEFAULT}), BOTH)}
    assert needs == {frozenset(): -450, frozenset({Region.DEFAULT}): 750, BOTH: 1150}
    # The update's peak wins where the KV cache is small: weights back, param buffer still resident.
    assert sleep_need(budget(0, kv_cache=0, cuda_graph=0), BOTH) == 300


@pytest.mark.parametrize(
    ("free", "kv", "kept"),
    [
        (1150, 1000, BOTH),  # both fit, to the byte
        (1149, 1000, {Region.DEFAULT}),  # default fits, then grad_buffer beside it does not
        (749, 1000, {Region.GRAD_BUFFER}),  # default does not fit, grad_buffer does
        (1949, 3000, set()),  # neither: grad_buffer alone needs 1950
    ],
)
def test_auto_keeps_what_the_rollout_fits_beside(free: int, kv: int, kept: set[Region]) -> None:
    chosen = choose(Offload.AUTO, budget(free, kv_cache=kv))
    assert chosen.keep == frozenset(kept)
    assert chosen.moves == frozenset(Region) - frozenset(kept)
    assert chosen.spare == free - sleep_need(budget(free, kv_cache=kv), frozenset(kept))
    assert chosen.spare >= 0


def test_always_keeps_nothing_and_never_both_or_refuses_naming_the_numbers() -> None:
    assert choose(Offload.ALWAYS, budget(10**9)).keep == frozenset()
    assert choose(Offload.NEVER, budget(1150)).keep == BOTH
    with pytest.raises(ConfigError) as refused:
        choose(Offload.NEVER, budget(1149))
    message = str(refused.value)
    assert "1,150 bytes" in message and "1,149 bytes" in message and "cuda:0" in message
    assert "default, grad_buffer" in message and "1,600 bytes" in message


def test_without_a_plan_auto_moves_everything_and_never_keeps_both() -> None:
    assert choose(Offload.AUTO, None).keep == frozenset()
    assert choose(Offload.NEVER, None).keep == BOTH
    assert choose(Offload.AUTO, None).spare is None


# ---- the lifecycle ----------------------------------------------------------------------------

ALWAYS_CALLS = [
    ("pause", "grad_buffer"),
    ("pause", "default"),
    ("pause", "param_buffer"),
    ("resume", "default"),
    ("resume", "grad_buffer"),
    ("resume", "param_buffer"),
]


@pytest.mark.parametrize(
    "config", [{}, {"offload": Offload.ALWAYS}, {"offload": "always", "memory": lambda: budget(10**9)}]
)
def test_always_and_auto_without_a_plan_move_every_region_as_before(config: dict[str, Any]) -> None:
    rig = make_rig(verify_cycles=2, **config)
    for _ in range(2):
        cycle(rig)
    assert rig.regions.calls == ALWAYS_CALLS * 2
    assert rig.lifecycle.residency.keep == frozenset()
    assert rig.lifecycle.last_restore_verified is True


def test_never_keeps_grad_buffer_and_default_resident_through_the_sleep() -> None:
    rig = make_rig(offload="never")
    lc = rig.lifecycle
    lc.pause_grads()
    assert lc.snapshot().paused == frozenset() and lc.snapshot().kept == BOTH
    lc.update_weights()
    lc.drop_params()
    lc.rollout(rig.engine.generate)
    assert lc.snapshot().paused == {Region.PARAM_BUFFER}
    lc.restore()
    lc.train(rig.trainer.optimizer_step)
    assert rig.regions.calls == [("pause", "param_buffer"), ("resume", "param_buffer")]
    assert lc.last_restore_verified is True and lc.snapshot().paused == frozenset()


def test_auto_skips_only_the_region_it_keeps() -> None:
    rig = make_rig(offload="auto", memory=lambda: budget(1149))
    assert rig.lifecycle.residency.keep == {Region.DEFAULT}
    cycle(rig)
    assert rig.regions.calls == [
        ("pause", "grad_buffer"),
        ("pause", "param_buffer"),
        ("resume", "grad_buffer"),
        ("resume", "param_buffer"),
    ]


def test_never_is_refused_at_construction_where_the_plan_says_it_cannot_fit() -> None:
    with pytest.raises(ConfigError, match="1,149 bytes"):
        make_rig(offload="never", memory=lambda: budget(1149))
    with pytest.raises(ConfigError, match="offload must be one of auto, always, never"):
        make_rig(offload="sometimes")


def test_memory_fits_refuses_a_sleep_whose_free_memory_no_longer_fits_the_choice() -> None:
    free = {"now": 1150}
    rig = make_rig(offload="never", memory=lambda: budget(free["now"]))
    cycle(rig)  # fits to the byte
    free["now"] = 1000  # another tenant took memory since the choice was made
    with pytest.raises(GuardRejected) as refused:
        rig.lifecycle.pause_grads()
    (verdict,) = refused.value.verdicts
    assert verdict.guard == "memory_fits"
    assert "needs 1,150 bytes" in verdict.reason and "1,000 bytes" in verdict.reason
    assert "keeps default, grad_buffer resident (1,600 bytes" in verdict.reason
    assert rig.lifecycle.phase is Phase.TRAIN and rig.regions.paused == set()


def test_the_guard_counts_kept_regions_resident_and_not_coming_back() -> None:
    limited = MemoryBudget(device_limit=3000, regions=REGIONS, engine=ENGINE)
    dropped = snap(phase=Phase.PARAMS_DROPPED, paused=frozenset({Region.PARAM_BUFFER}), kept=BOTH)
    dropped = replace(dropped, engine_resident=frozenset({EngineMemory.WEIGHTS}), memory=limited)
    assert device_free(dropped, limited) == 3000 - 1600 - 300
    assert memory_fits(dropped).ok  # KV + graphs (1050) in the 1100 left
    tight = replace(dropped, memory=replace(limited, device_limit=2949))
    verdict = memory_fits(tight)
    assert not verdict.ok and "needs 1,050 bytes" in verdict.reason and "1,049 bytes" in verdict.reason
    assert "keeps default, grad_buffer resident" in verdict.reason
    # restore brings back the param buffer alone, after the engine's 1350 are released
    rollout = replace(dropped, phase=Phase.ROLLOUT, engine_resident=frozenset(EngineMemory))
    assert memory_fits(replace(rollout, memory=budget(0))).ok
    assert memory_fits(snap(phase=Phase.TRAIN, memory=budget(0))).ok  # nothing kept: nothing to check


# ---- the plan and the command line --------------------------------------------------------------


def test_the_plan_keeps_what_fits_and_prices_both_ways() -> None:
    m, par = load_model("qwen3-4b"), Parallelism(tp=2, dp=2)
    auto, always = plan(m, par), plan(m, par, offload=Offload.ALWAYS)
    r = auto.ranks[0]
    assert auto.kept(r) == BOTH and always.kept(r) == frozenset()
    assert auto.phases(r)["rollout"][0] == always.phases(r)["rollout"][0] + r.grad_buffer + r.optimizer_state
    assert auto.phases(r)["rollout"][1] == 0 < always.phases(r)["rollout"][1]  # no CPU copy of default
    assert auto.kv_token_bytes == 2 * 2 * 36 * 4 * 128  # K and V, 36 layers, 8 KV heads over 2 GPUs
    by_region = {x.region: x for x in prices(auto, r, gbps=25.0)}
    assert by_region[Region.DEFAULT].move_s == pytest.approx(2 * r.optimizer_state / 25e9)
    assert by_region[Region.GRAD_BUFFER].move_s == 0.0  # paused without a backup: nothing copied
    assert by_region[Region.GRAD_BUFFER].kv_tokens == r.grad_buffer // auto.kv_token_bytes
    with pytest.raises(ConfigError, match="offload never keeps"):
        plan(m, Parallelism(), offload=Offload.NEVER)
    sized = plan(m, par, engine=EngineSpec(kv_tokens=1000))
    assert sized.kv_cache == 1000 * sized.kv_token_bytes


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_plan_offload_options_and_bad_values() -> None:
    done = _invoke("plan", "qwen3-4b", "--tp", "2", "--dp", "2", "--offload", "auto", "--pcie-gbps", "25", "--json")
    assert done.exit_code == 0, done.output
    got = json.loads(done.stdout)
    assert got["offload"] == {"policy": "auto", "pinned_copy_gbps": 25.0}
    default = got["stages"][0]["offload"]["default"]
    assert default["stays"] is True and default["move_seconds_per_step"] == pytest.approx(2 * default["bytes"] / 25e9)
    table = _invoke("plan", "qwen3-4b", "--tp", "2", "--dp", "2", "--offload", "always")
    assert table.exit_code == 0 and "KV tokens given up" in table.stdout and "stays" not in table.stdout
    for bad, says in (
        (["--offload", "sometimes"], "sometimes"),
        (["--pcie-gbps", "0"], "--pcie-gbps must be a positive rate"),
        (["--offload", "never", "--tp", "1", "--dp", "1"], "offload never keeps"),
    ):
        refused = _invoke("plan", "qwen3-4b", *bad)
        assert refused.exit_code == 2, refused.output
        assert says in refused.output


def test_run_takes_offload_and_refuses_a_bad_value() -> None:
    assert RunConfig().offload is Offload.AUTO
    refused = _invoke("run", "--offload", "sometimes")
    assert refused.exit_code == 2 and "sometimes" in refused.output
    with pytest.raises(ConfigError, match="--offload must be one of"):
        RunConfig(offload="sometimes")  # type: ignore[arg-type]
