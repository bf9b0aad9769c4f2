"""How many ranks a machine or an attached Ray cluster can hold (orchestrator/job/capacity.py),
judged without starting Ray."""

from __future__ import annotations

import pytest

from orchestrator.job.capacity import GIB, PROCESS_BYTES, cluster_problems

ADDRESS = "10.0.0.1:6379"


def test_a_cluster_with_a_bundle_for_each_rank_and_the_engine_holds_the_run() -> None:
    resources = {"CPU": 4.0, "memory": 8.0 * GIB, "object_store_memory": 2.0 * GIB}
    assert cluster_problems(resources, address=ADDRESS, ranks=3, cuda=False, engine_bundle=True) == []


@pytest.mark.parametrize(
    ("resources", "ranks", "cuda", "problem"),
    [
        (
            {"CPU": 4.0, "memory": 8.0 * GIB},
            4,
            False,
            "--ranks 4 needs 5 CPU(s) (a bundle of one CPU per rank, one for the engine), "
            f"and the Ray cluster at {ADDRESS} has 4",
        ),
        (
            {"CPU": 16.0, "GPU": 2.0, "memory": 64.0 * GIB},
            4,
            True,
            f"--ranks 4 needs 4 GPU(s) (a GPU per rank), and the Ray cluster at {ADDRESS} has 2",
        ),
        (
            {"CPU": 64.0, "memory": 2.0 * GIB},
            8,
            False,
            f"--ranks 8: 9 processes need {9 * PROCESS_BYTES / GIB:.1f} GiB of memory at the least, "
            f"and the Ray cluster at {ADDRESS} has 2.0 GiB",
        ),
    ],
)
def test_a_cluster_too_small_is_named_with_what_it_has(
    resources: dict[str, float], ranks: int, cuda: bool, problem: str
) -> None:
    assert cluster_problems(resources, address=ADDRESS, ranks=ranks, cuda=cuda, engine_bundle=True) == [problem]


def test_an_engine_served_elsewhere_takes_no_bundle() -> None:
    resources = {"CPU": 2.0, "GPU": 2.0, "memory": 8.0 * GIB}
    assert cluster_problems(resources, address=ADDRESS, ranks=2, cuda=False, engine_bundle=False) == []
