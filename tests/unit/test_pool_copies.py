"""A `WorkerPool` sent to a worker (rank 0 gets the engine's pool with every push) travels
without its sentinels: their refs are of calls that never end, and each one a worker unpickles
costs the driver and that worker an RPC that is never answered, every push (benchmarks/soak.py)."""

from __future__ import annotations

import pickle

import pytest

from orchestrator.job.workers.pool import Sentinels, WorkerPool
from orchestrator.job.workers.traced import Traced

# What `Sentinels.watch` keeps, by the ref of each worker's `until_exit` call; a string stands in
# for a ref here (a real one needs a cluster), which is all pickling sees of it.
NEVER_ENDS = "ObjectRef(until_exit of engine replica 0)"


def watched_pool() -> WorkerPool[Traced]:
    sentinels = Sentinels()
    sentinels._watched[NEVER_ENDS] = ("actor", "engine replica 0", 4242)
    pool: WorkerPool[Traced] = WorkerPool([], label="engine", remote=True, timeout=7.0, sentinels=sentinels)
    pool.pids = {0: 4242}
    return pool


@pytest.mark.parametrize("dumps", [pickle.dumps, pytest.param("ray", id="ray.cloudpickle")])
def test_a_copy_sent_to_a_worker_carries_no_sentinel(dumps: object) -> None:
    if dumps == "ray":
        dumps = pytest.importorskip("ray.cloudpickle").dumps
    pool = watched_pool()
    blob = dumps(pool)  # type: ignore[operator]
    assert NEVER_ENDS.encode() not in blob
    copy = pickle.loads(blob)
    assert copy.sentinels is None
    assert (copy.label, copy.remote, copy.timeout, copy.pids) == ("engine", True, 7.0, {0: 4242})
    assert pool.sentinels is not None and pool.sentinels.refs == [NEVER_ENDS]  # the driver's own still watch
