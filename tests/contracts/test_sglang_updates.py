"""What an SGLang server serves across a weight update, path by path, as the stand-in records it.

The stand-in (tests/support/sglang_server.py) records, after every weight-update request, the
version the server serves then (`state.versions`), as SGLang 0.5.23 records it: any successful
update that carries a `weight_version` moves it, and /update_weight_version sets it.

The paths by which buckets reach a server:
- in process: the lifecycle's own engine object pushes them;
- by value: a copy of the engine pushes them, as the rank-0 Ray actor of a two-rank run does
  (Ray pickles the argument; here a pickle round trip stands for Ray's transport);
- by broadcast: `WeightBroadcaster` in a process of its own announces them (its fresh engine objects);
- a fresh adapter: a new `SGLangGroup` meets a server an earlier run updated.

In every path the promise is the same: the served version moves exactly once per update, after
its last bucket and the session's close, and never for an update that failed.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from orchestrator import Lifecycle, LifecycleConfig
from orchestrator.adapters.engines.sglang import SGLangGroup
from orchestrator.adapters.transport.bucketed import push_in_buckets
from orchestrator.errors import ActionFailed, EngineError
from orchestrator.protocols import BucketSink, TransferReport
from orchestrator.testing import InMemoryRegions, InMemoryTrainer
from states import Mode, Phase, Region
from tests.support.cli import ROOT
from tests.support.sglang_server import SGLangStandIn
from tests.support.sglang_weights import WEIGHTS, tensors

BUCKET_BYTES = 600  # the four weights in three buckets
TENSOR = "/update_weights_from_tensor"


def served_across(server: SGLangStandIn, old: str, new: str | None, *, buckets: int, route: str = TENSOR) -> list:
    """The versions a server records across one update of `buckets` buckets from `old`: `new` once,
    after the session closed; None: an update that failed at its last bucket, and left `old`."""
    expected = [("/begin_weight_update", old), *[(route, old)] * buckets, ("/end_weight_update", old)]
    return expected + ([("/update_weight_version", new)] if new is not None else [])


class Push:
    """The job's weight transport, pushing every bucket through `sink` (the engine, or a copy of it)."""

    def __init__(self, sink: BucketSink) -> None:
        self.sink = sink

    def push(self, version: int) -> TransferReport:
        return push_in_buckets(tensors(seed=version), self.sink, version, bucket_bytes=BUCKET_BYTES)


def lifecycle(group: SGLangGroup, sink: BucketSink, trainer: InMemoryTrainer) -> Lifecycle:
    return Lifecycle(
        config=LifecycleConfig(mode=Mode.REMATERIALIZE),
        trainer=trainer,
        regions=InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop}),
        engine=group,
        transport=Push(sink),
    )


@pytest.fixture
def server() -> Iterator[SGLangStandIn]:
    with SGLangStandIn(weights=WEIGHTS) as s:
        yield s


@pytest.mark.parametrize("path", ["in process", "by value"])
def test_the_lifecycle_moves_the_version_once_after_the_last_bucket_and_never_for_a_failed_update(
    server: SGLangStandIn, path: str
) -> None:
    group = SGLangGroup([server.url])
    sink = group if path == "in process" else pickle.loads(pickle.dumps(group))
    trainer = InMemoryTrainer()
    lc = lifecycle(group, sink, trainer)
    lc.pause_grads()
    lc.update_weights()
    assert server.state.versions == served_across(server, "default", "1", buckets=3)

    for event in (lc.drop_params, lc.rollout, lc.restore):
        event()
    lc.train(trainer.optimizer_step)  # the next step has weights to push
    lc.pause_grads()
    server.state.versions.clear()
    server.state.fail_at_bucket = 2  # the second of three buckets fails
    with pytest.raises(ActionFailed, match="Failed to load bucket 2"):
        lc.update_weights()
    assert lc.phase is Phase.FAULTED
    assert server.state.versions == served_across(server, "1", None, buckets=2)
    assert server.state.weight_version == "1" and not server.state.session_open


def test_a_fresh_adapter_against_a_running_server_moves_its_version_only_at_the_end(server: SGLangStandIn) -> None:
    """A second run or a restarted trainer: a new adapter, a server that serves an earlier run's
    version 7 and still has that run's session open (it was killed mid-update)."""
    earlier = SGLangGroup([server.url])
    with earlier.weight_update_session(7):
        push_in_buckets(tensors(seed=7), earlier, 7, bucket_bytes=BUCKET_BYTES)
    server.state.session_open = True
    server.state.versions.clear()

    fresh = SGLangGroup([server.url])
    server.state.fail_at_bucket = 2
    with pytest.raises(EngineError, match="Failed to load bucket 2"), fresh.weight_update_session(8):
        push_in_buckets(tensors(seed=8), fresh, 8, bucket_bytes=BUCKET_BYTES)
    left_open = [("/begin_weight_update", "7"), ("/end_weight_update", "7")]  # refused: closed, then opened anew
    assert server.state.versions == [*left_open, *served_across(server, "7", None, buckets=2)]
    assert server.state.weight_version == "7"

    server.state.versions.clear()
    with fresh.weight_update_session(8):
        push_in_buckets(tensors(seed=8), fresh, 8, bucket_bytes=BUCKET_BYTES)
    assert server.state.versions == served_across(server, "7", "8", buckets=3)


def broadcast(url: str, *, versions: int) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tests.support.broadcast_sender", url, "--port", str(port)]
    command += ["--versions", str(versions), "--timeout", "10"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=80)


@pytest.mark.timeout(120)
def test_the_broadcasters_announcements_move_the_version_once_per_update() -> None:
    with SGLangStandIn(weights=WEIGHTS, join_groups=True) as server:
        done = broadcast(server.url, versions=2)
        assert done.returncode == 0, done.stderr[-2000:]
        route = "/update_weights_from_distributed"
        assert server.state.versions == [
            *served_across(server, "default", "1", buckets=3, route=route),
            *served_across(server, "1", "2", buckets=3, route=route),
        ]
        server.state.versions.clear()
        server.state.fail_at_bucket = 2
        done = broadcast(server.url, versions=1)
        assert done.returncode != 0 and "Failed to load bucket 2" in done.stderr, done.stderr[-2000:]
        assert server.state.versions == served_across(server, "2", None, buckets=2, route=route)
        assert server.state.weight_version == "2"


# ---- generation held around an update (`--engine-pause`) --------------------------------------


def routes(server: SGLangStandIn) -> list[str]:
    return [path.split("?")[0] for path, _ in server.state.requests]


def test_generation_is_paused_before_an_update_and_goes_on_only_after_one_that_succeeded(
    server: SGLangStandIn,
) -> None:
    group = SGLangGroup([server.url])  # retract: the default
    with group.weight_update_session(1):
        push_in_buckets(tensors(seed=1), group, 1, bucket_bytes=BUCKET_BYTES)
    assert routes(server) == [
        "/pause_generation",
        "/begin_weight_update",
        *[TENSOR] * 3,
        "/end_weight_update",
        "/update_weight_version",
        "/continue_generation",
    ]
    assert server.state.requests[0][1] == {"mode": "retract"} and server.state.paused is None

    server.state.fail_at_bucket = 1
    with pytest.raises(EngineError, match="Failed to load bucket 1"), group.weight_update_session(2):
        push_in_buckets(tensors(seed=2), group, 2, bucket_bytes=BUCKET_BYTES)
    assert server.state.paused == "retract", "a part-updated server must not serve"
    assert "/continue_generation" not in routes(server)[8:]
    with pytest.raises(EngineError, match="generation is paused"):
        group.engines[0].generate([[1, 2]], {"max_new_tokens": 2})

    with group.weight_update_session(2):  # the next update that succeeds lets generation go on
        push_in_buckets(tensors(seed=2), group, 2, bucket_bytes=BUCKET_BYTES)
    assert server.state.paused is None and routes(server)[-1] == "/continue_generation"
    assert len(group.engines[0].generate([[1, 2]], {"max_new_tokens": 2})[0].token_ids) == 2


def test_a_retract_pause_lets_the_update_flush_while_requests_wait(server: SGLangStandIn) -> None:
    server.hold(requests=2, polls=1000)  # requests that never finish on their own
    group = SGLangGroup([server.url], flush_max_wait_s=0.5, flush_poll_s=0.01)
    with group.weight_update_session(1):
        push_in_buckets(tensors(seed=1), group, 1, bucket_bytes=BUCKET_BYTES)
        group.flush_cache()  # SGLang ignores the waiting queue while its scheduler is paused
    assert server.state.weight_version == "1"


def test_an_in_place_pause_keeps_the_requests_and_sglang_refuses_the_flush(server: SGLangStandIn) -> None:
    server.hold(requests=2, polls=1000)
    group = SGLangGroup([server.url], pause="in_place", flush_max_wait_s=0.2, flush_poll_s=0.01)
    with pytest.raises(EngineError, match="still refused"), group.weight_update_session(1):
        push_in_buckets(tensors(seed=1), group, 1, bucket_bytes=BUCKET_BYTES)
        group.flush_cache()
    assert server.state.weight_version == "default" and server.state.in_flight == 2


def test_an_abort_pause_aborts_until_the_server_is_idle(server: SGLangStandIn) -> None:
    server.hold(requests=3, polls=1000)
    server.state.aborts_needed = 3  # the pause's own abort, then two /abort_request
    group = SGLangGroup([server.url], pause="abort", flush_max_wait_s=2.0, flush_poll_s=0.01)
    with group.weight_update_session(1):
        assert server.state.in_flight == 0
        push_in_buckets(tensors(seed=1), group, 1, bucket_bytes=BUCKET_BYTES)
        group.flush_cache()
    assert server.state.requests[0][1] == {"mode": "abort"} and server.state.weight_version == "1"
    assert [body for path, body in server.state.requests if path == "/abort_request"] == [{"abort_all": True}] * 2


def test_requests_that_outlast_every_abort_fail_the_update_before_it_starts(server: SGLangStandIn) -> None:
    server.hold(requests=1, polls=1000)
    server.state.aborts_needed = 10**6
    group = SGLangGroup([server.url], pause="abort", flush_max_wait_s=0.3, flush_poll_s=0.01)
    still = r"requests still in flight 0.3 s after aborting all"
    with pytest.raises(EngineError, match=still), group.weight_update_session(1):
        raise AssertionError("unreachable: the update must not start")
    assert "/begin_weight_update" not in routes(server) and server.state.weight_version == "default"


def test_no_pause_sends_nothing_around_the_update(server: SGLangStandIn) -> None:
    group = SGLangGroup([server.url], pause="none")
    with group.weight_update_session(1):
        push_in_buckets(tensors(seed=1), group, 1, bucket_bytes=BUCKET_BYTES)
    assert not {"/pause_generation", "/continue_generation"} & set(routes(server))


def test_an_unknown_pause_is_a_config_error() -> None:
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError, match="engine pause 'hold': not one of retract, abort, in_place, none"):
        SGLangGroup(["http://127.0.0.1:1"], pause="hold")


# ---- handing the servers back (`SGLangGroup.close`) ---------------------------------------------


def test_close_hands_back_what_it_can_and_names_a_server_that_cannot_take_the_call() -> None:
    """The promise: at close every server gets its memory back and loses this job's weight-update
    group; a server that cannot take a call is a `leftover` warning line, not an error, and the
    others are still handed back."""
    import structlog

    from states import EngineMemory

    every = frozenset(EngineMemory)
    with SGLangStandIn() as alive, SGLangStandIn() as dead:
        group = SGLangGroup([alive.url, dead.url])
        group.release(every)
        group.engines[0].init_weights_update_group("127.0.0.1", 1, rank_offset=1, world_size=2, group_name="g")
        group.destroy_at_close("g")
        dead.state.dead = "killed"
        with structlog.testing.capture_logs() as logs:
            group.close()
        assert alive.state.released == set() and alive.state.destroyed == ["g"] and not alive.state.groups
    leftovers = [line for line in logs if line["event"] == "leftover"]
    assert [line["component"] for line in leftovers] == [dead.url, dead.url]  # its group, then its memory
    assert "not destroyed" in leftovers[0]["done"] and "not resumed" in leftovers[1]["done"]
