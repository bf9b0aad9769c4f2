"""One payload per SGLang TP rank, each serialized by the trainer rank on that TP rank's GPU.

SGLang's TP rank i unpickles entry i of `serialized_named_tensors` alone and maps the memory it
names. Colocated, that must be the memory of the trainer rank on its GPU: the driver walks the
ranks through their buckets together (`fanout.PerTpRankPush`) and posts each server its ranks'
payloads. Here the ranks are `TrainerRank`s with given weights, each in a process of its own
(tests/support/tp_ranks.py), and the server is the stand-in, which records where each payload's
memory lives (`payload_origin`: on the CPU, the process that shared the file).

Not run here (no GPU): the CUDA path, where a payload names its GPU by UUID and
`payload_origin` reads "cuda <uuid>"; only its decoding is checked, on a payload built by hand.
"""

from __future__ import annotations

import base64
import inspect
import pickle
from collections.abc import Iterator

import pytest
import torch
from torch.multiprocessing import reductions

from orchestrator.adapters.engines.sglang import SGLangGroup
from orchestrator.errors import ConfigError, RankFailed
from orchestrator.job.workers.pool import WorkerPool
from orchestrator.job.workers.trainer_rank import TrainerRank
from orchestrator.job.workers.transports import tensor_push
from orchestrator.protocols import TransferReport
from tests.support.sglang_server import SGLangStandIn, payload_origin
from tests.support.sglang_weights import WEIGHTS, tensors
from tests.support.tp_ranks import GivenWeightsRank, rank_processes

pytestmark = pytest.mark.timeout(120)

BUCKET_BYTES = 600  # three buckets of `tensors()`: the embedding; q_proj and the norm; lm_head
BUCKETS = 3
WEIGHT_BYTES = sum(t.numel() * t.element_size() for _, t in tensors())


@pytest.fixture(scope="module")
def ranks() -> Iterator[WorkerPool[TrainerRank]]:
    with rank_processes(2) as pool:
        yield pool


def push(servers: list[SGLangStandIn], ranks: WorkerPool[TrainerRank]) -> TransferReport:
    """One update of every weight, from `ranks` to `servers`, as the job's lifecycle makes it."""
    group = SGLangGroup([s.url for s in servers])
    try:
        group.connect()
        transport = tensor_push(ranks, group, BUCKET_BYTES)
        with group.weight_update_session(version=1):
            return transport.push(1)
    finally:
        group.close()


def origins(ranks: WorkerPool[TrainerRank], *indices: int) -> list[str]:
    return [f"pid {ranks.pids[i]}" for i in indices]


def test_each_tp_rank_maps_the_memory_of_the_trainer_rank_on_its_gpu(ranks: WorkerPool[TrainerRank]) -> None:
    """Before each rank serialized its own bucket, rank 0 serialized its bucket once per TP rank:
    both payloads came from rank 0's process."""
    with SGLangStandIn(tp_size=2, weights=WEIGHTS) as server:
        report = push([server], ranks)
        assert server.state.payload_origins == [origins(ranks, 0, 1)] * BUCKETS
        loaded = dict(server.state.loaded)
    assert loaded.keys() == WEIGHTS.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors())
    assert report == TransferReport(tensors=len(WEIGHTS), bytes=WEIGHT_BYTES, buckets=BUCKETS)


def test_servers_take_consecutive_ranks(ranks: WorkerPool[TrainerRank]) -> None:
    with SGLangStandIn(weights=WEIGHTS) as a, SGLangStandIn(weights=WEIGHTS) as b:
        report = push([a, b], ranks)
        assert a.state.payload_origins == [origins(ranks, 0)] * BUCKETS
        assert b.state.payload_origins == [origins(ranks, 1)] * BUCKETS
    assert report.bytes == 2 * WEIGHT_BYTES  # what each server loaded


def test_ranks_past_the_servers_tp_ranks_stay_idle() -> None:
    """Rank 1 lacks a weight, which would fail the push had it been asked for a bucket."""
    ranks = WorkerPool([GivenWeightsRank(0), GivenWeightsRank(1, tensors()[:-1])], label="rank", remote=False)
    with SGLangStandIn(weights=WEIGHTS) as server:
        report = push([server], ranks)
        assert server.state.loaded.keys() == WEIGHTS.keys()
    assert report == TransferReport(tensors=len(WEIGHTS), bytes=WEIGHT_BYTES, buckets=BUCKETS)


def test_more_tp_ranks_than_trainer_ranks_is_a_config_error_naming_both() -> None:
    ranks = WorkerPool([GivenWeightsRank(0), GivenWeightsRank(1)], label="rank", remote=False)
    with SGLangStandIn(tp_size=2) as a, SGLangStandIn() as b:
        group = SGLangGroup([a.url, b.url])
        group.connect()
        with pytest.raises(ConfigError, match=r"3 TP ranks \(2 \+ 1\) and the trainer 2 ranks"):
            tensor_push(ranks, group, BUCKET_BYTES)
        group.close()


def test_a_rank_whose_buckets_differ_fails_the_push_naming_it_and_lets_its_bucket_go() -> None:
    """Rank 1 lacks lm_head, the last bucket: the two buckets before it are posted, the third is not."""
    shorter = GivenWeightsRank(1, tensors()[:-1])
    ranks = WorkerPool([GivenWeightsRank(0), shorter], label="rank", remote=False)
    with SGLangStandIn(tp_size=2, weights=WEIGHTS) as server:
        with pytest.raises(RankFailed, match=r"rank 1 .*its bucket 2 is none \(past its last\); rank 0's is 1 tensors"):
            push([server], ranks)
        assert len(server.state.payload_origins) == BUCKETS - 1
        assert server.state.session_open is False
    with pytest.raises(RuntimeError, match="next_payload before start_payloads"):
        shorter.next_payload()


def test_one_payload_per_tp_rank_or_nothing_is_posted() -> None:
    with SGLangStandIn(tp_size=2) as server:
        group = SGLangGroup([server.url])
        group.connect()
        with pytest.raises(ValueError, match="1 payloads for 2 TP ranks"):
            group.engines[0].update_weights_from_payloads(["payload"])
        group.close()
        assert not [path for path, _ in server.state.requests if path == "/update_weights_from_tensor"]


def test_a_cuda_payloads_origin_is_the_device_uuid_where_torch_takes_the_device() -> None:
    """The CUDA decode, on a payload built by hand: `rebuild_cuda_tensor`'s `storage_device`
    (where SGLang's wire puts the UUID) is read, nothing is opened. No GPU ran it."""
    parameters = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    args: list[object] = [torch.Tensor, (4,), (1,), 0, torch.UntypedStorage, torch.uint8, None, b"ipc", 4, 0]
    args[parameters.index("storage_device")] = "GPU-0b7e5c9a"
    args += [False, b"counter", 0, b"event", True]

    class CudaTensor:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return reductions.rebuild_cuda_tensor, tuple(args)

    payload = base64.b64encode(pickle.dumps({"flattened_tensor": CudaTensor(), "metadata": []})).decode()
    assert payload_origin(payload) == "cuda GPU-0b7e5c9a"
