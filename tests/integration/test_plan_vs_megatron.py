"""The plan against real megatron-core ranks (gloo, CPU), buffer by buffer, to the byte.

The model is the `cpu` benchmark model of orchestrator/demo/presets.py (4 layers, the last MoE with
expert_bias, an fp32 param, a frozen norm), built by `megatron_build.build_gpt` in DDP +
DistributedOptimizer after one Adam step, at DP=1, DP=2 and DP=2 with EP=2.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from benchmarks.plan_vs_measured import measure, planned, rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (2, 2)], ids=lambda p: f"dp{p[0]}-ep{p[1]}")
def measured(request: pytest.FixtureRequest) -> tuple[int, int, list[dict[str, Any]]]:
    dp, ep = request.param
    return dp, ep, measure("cpu", [dp], ep)["runs"][str(dp)]


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
