"""One payload per SGLang TP rank by CUDA IPC: each trainer rank, a process of its own, serializes
its bucket from its GPU's memory, and the stand-in server maps every payload as SGLang's patched
`rebuild_cuda_tensor` does (the device named by UUID on the wire).

With one GPU both ranks share it, so this checks that each payload is a CUDA IPC handle of that
GPU's memory, made in its rank's process and mapped by the server, with the values intact; which
GPU each TP rank gets is checked on the CPU (tests/contracts/test_sglang_tp_payloads.py: by the
process that shared the memory) and here only where two GPUs are visible.
"""

from __future__ import annotations

import pytest
import torch

from tests.contracts.test_sglang_tp_payloads import BUCKETS, push
from tests.support.sglang_server import SGLangStandIn
from tests.support.sglang_weights import WEIGHTS, tensors
from tests.support.tp_ranks import rank_processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def test_each_tp_rank_maps_the_cuda_memory_of_its_trainer_rank() -> None:
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    with rank_processes(2, device="cuda") as ranks, SGLangStandIn(tp_size=2, weights=WEIGHTS) as server:
        push([server], ranks)
        expected = [f"cuda {uuids[rank % len(uuids)]}" for rank in (0, 1)]
        assert server.state.payload_origins == [expected] * BUCKETS
        loaded = {name: t.cpu() for name, t in server.state.loaded.items()}
    assert loaded.keys() == WEIGHTS.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors())
