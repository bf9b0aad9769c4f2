"""Which optimizers the Triton cast takes, and that every other one gets Megatron's own loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.adapters.megatron.fast_cast import MainParamCast, cast_pairs


class _Optimizer(SimpleNamespace):
    """Stands in for a DistributedOptimizer: only what the plan reads, and a cast that counts."""

    def __init__(self, **flags: bool) -> None:
        super().__init__(
            shard_fp32_from_float16_groups=[],
            model_float16_groups=[],
            shard_fp32_groups=[],
            model_fp32_groups=[],
            config=SimpleNamespace(use_precision_aware_optimizer=flags.pop("precision_aware", False)),
            ddp_config=SimpleNamespace(**flags),
            casts=0,
        )

    def _copy_main_params_to_model_params(self) -> None:
        self.casts += 1


@pytest.mark.parametrize("flag", ["use_megatron_fsdp", "fp8_param_gather", "fp4_param_gather", "precision_aware"])
def test_a_cast_that_is_more_than_a_copy_has_no_plan(flag: str) -> None:
    assert cast_pairs(_Optimizer(**{flag: True})) is None
    assert cast_pairs(_Optimizer()) == ([], [])


def test_an_optimizer_without_distributed_shards_has_no_plan() -> None:
    assert cast_pairs(SimpleNamespace(config=None)) is None


def test_without_the_kernel_megatrons_loop_runs_for_every_optimizer() -> None:
    optimizers = [_Optimizer(), _Optimizer(fp8_param_gather=True)]
    cast = MainParamCast([*optimizers, None])  # ChainedOptimizer may hold None
    assert cast.path == "megatron"
    cast()
    assert [o.casts for o in optimizers] == [1, 1]


def test_forcing_the_kernel_where_it_cannot_run_is_refused() -> None:
    with pytest.raises(RuntimeError, match="Triton cast cannot run here"):
        MainParamCast([_Optimizer(fp8_param_gather=True)], use_kernel=True)
