"""What the lifecycle relies on from each Protocol (orchestrator/protocols.py, core/actions.py),
as checks that take one case of `tests/support/contract_cases.py`.

Plain functions, not tests: `tests/contracts/test_protocol_contracts.py` runs each over every
case, and a case that must live in a process of its own (a Megatron trainer) runs them there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import structlog
import torch

from orchestrator import Lifecycle, LifecycleConfig
from orchestrator.core.regions import RegionLedger
from orchestrator.errors import EngineError, RegionRefused
from orchestrator.protocols import MemoryRegions, RolloutEngine, WeightTransport
from orchestrator.testing import InMemoryRegions, InMemoryTrainer
from states import EngineMemory, Phase, Region
from tests.support.contract_cases import NO_BACKUP, EngineCase, RegionsCase
from tests.support.transport_cases import TransportCase

ALL = frozenset(EngineMemory)


WEIGHTS = frozenset({EngineMemory.WEIGHTS})
KV = frozenset({EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH})
PAUSE_ORDER = (Region.GRAD_BUFFER, Region.DEFAULT, Region.PARAM_BUFFER)  # pause_grads, then drop_params


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- MemoryRegions ------------------------------------------------------------------------------


def regions_manage_every_tag(case: RegionsCase) -> None:
    """The ledger refuses an adapter that lacks a tag the lifecycle pauses."""
    assert isinstance(case.regions, MemoryRegions)
    assert {r.value for r in Region} <= case.regions.tags()
    RegionLedger(case.regions)


def pause_frees_what_it_reports_and_resume_retakes_it(case: RegionsCase) -> None:
    """Each pause returns the bytes the memory really got back (measured outside the adapter), a
    tag without backup at least its buffer; each resume retakes as much; twice over, since every
    step pauses and resumes again."""
    for _ in range(2):
        freed = {}
        for tag in PAUSE_ORDER:
            before = case.free()
            freed[tag] = case.regions.pause(tag)
            gained = case.free() - before
            assert abs(gained - freed[tag]) <= case.tolerance, f"pause({tag}) reported {freed[tag]}, freed {gained}"
            if tag in NO_BACKUP:
                assert freed[tag] >= nbytes(case.tensors[tag][0]) - case.tolerance, f"pause({tag}) freed too little"
        for tag in reversed(PAUSE_ORDER):
            before = case.free()
            retaken = case.regions.resume(tag)
            if tag in NO_BACKUP:  # touch what came back: pages count once written
                case.tensors[tag][0].zero_()
            taken = before - case.free()
            assert abs(taken - retaken) <= case.tolerance, f"resume({tag}) reported {retaken}, took {taken}"
            assert abs(retaken - freed[tag]) <= case.tolerance, f"resume({tag}) retook {retaken} of {freed[tag]}"


def default_keeps_its_contents(case: RegionsCase) -> None:
    """`default` (fp32 mains, Adam state) is paused with a backup: its contents survive."""
    kept = [t.clone() for t in case.tensors[Region.DEFAULT]]
    for tag in PAUSE_ORDER:
        case.regions.pause(tag)
    for tag in reversed(PAUSE_ORDER):
        case.regions.resume(tag)
    for before, after in zip(kept, case.tensors[Region.DEFAULT], strict=True):
        assert torch.equal(before, after), "default lost its contents across a pause"


def views_see_the_resumed_memory(case: RegionsCase) -> None:
    """Megatron's params are views of one buffer: after a resume, a write through a view is a
    write into the buffer (the view was not left on freed memory)."""
    buffer, view = case.tensors[Region.PARAM_BUFFER][:2]
    case.regions.pause(Region.PARAM_BUFFER)
    case.regions.resume(Region.PARAM_BUFFER)
    storage = view.untyped_storage()  # checked first: a write through a view left on freed memory crashes
    assert storage.data_ptr() == buffer.untyped_storage().data_ptr(), "the view is not on the resumed buffer"
    assert storage.nbytes() >= (view.storage_offset() + view.numel()) * view.element_size(), "the view's memory is gone"
    view.fill_(3)
    assert bool((buffer[7:99] == 3).all()), "the view no longer aliases the resumed buffer"


def resume_keeps_the_addresses(case: RegionsCase) -> None:
    """protocols.MemoryRegions.resume: torch_memory_saver (and the in-memory adapter) map the same
    virtual addresses again, what CUDA graphs and IPC handles into the buffers need."""
    if not case.keeps_addresses:
        pytest.skip("this adapter's resume reallocates: its tensors see the memory, at new addresses")
    addresses = {tag: ts[0].data_ptr() for tag, ts in case.tensors.items()}
    for tag in PAUSE_ORDER:
        case.regions.pause(tag)
    for tag in reversed(PAUSE_ORDER):
        case.regions.resume(tag)
    assert {tag: ts[0].data_ptr() for tag, ts in case.tensors.items()} == addresses


def the_ledger_refuses_a_second_pause_before_the_adapter_acts(case: RegionsCase) -> None:
    """torch_memory_saver exits the process on a double pause or a stray resume: the ledger in
    front of every adapter refuses both, and the memory is as it was."""
    ledger = RegionLedger(case.regions)
    with pytest.raises(RegionRefused, match="not paused"):
        ledger.resume(Region.GRAD_BUFFER)
    ledger.pause(Region.GRAD_BUFFER)
    before = case.free()
    with pytest.raises(RegionRefused, match="already paused"):
        ledger.pause(Region.GRAD_BUFFER)
    assert abs(case.free() - before) <= case.tolerance
    ledger.resume(Region.GRAD_BUFFER)


def tensors_made_later_are_paused_too(case: RegionsCase) -> None:
    """Adam's moments appear at the first optimizer step, after the regions were built (and maybe
    after a first pause): a later pause frees them too, and `default` keeps theirs."""
    for tag in (Region.GRAD_BUFFER, Region.DEFAULT):
        case.regions.pause(tag)
        case.regions.resume(tag)
    case.tensors[Region.GRAD_BUFFER][0].zero_()  # grads are zeroed before use: its pages count again
    late_grads = torch.ones_like(case.tensors[Region.GRAD_BUFFER][0])
    late_state = torch.ones_like(case.tensors[Region.DEFAULT][0])
    case.tensors[Region.GRAD_BUFFER].append(late_grads)
    case.tensors[Region.DEFAULT].append(late_state)
    before = case.free()
    freed = case.regions.pause(Region.GRAD_BUFFER)
    both = nbytes(case.tensors[Region.GRAD_BUFFER][0]) + nbytes(late_grads)
    assert freed >= both - case.tolerance and case.free() - before >= both - case.tolerance, "the late grads stayed"
    case.regions.pause(Region.DEFAULT)
    case.regions.resume(Region.DEFAULT)
    case.regions.resume(Region.GRAD_BUFFER)
    assert torch.equal(late_state, torch.ones_like(late_state)), "the late optimizer state lost its contents"


def paused_says_which_tags_are_paused(case: RegionsCase) -> None:
    """protocols.MemoryRegions.paused: each tag from its pause until its resume, and no other."""
    assert case.regions.paused == frozenset()
    done: set[str] = set()
    for tag in PAUSE_ORDER:
        case.regions.pause(tag)
        done.add(tag)
        assert case.regions.paused == done, f"after pause({tag})"
    for tag in reversed(PAUSE_ORDER):
        case.regions.resume(tag)
        done.discard(tag)
        assert case.regions.paused == done, f"after resume({tag})"


def _noops(logs: list[dict[str, Any]]) -> list[str]:
    return [log["call"] for log in logs if log["event"] == "noop"]


def a_second_pause_and_a_stray_resume_are_noops(case: RegionsCase) -> None:
    """protocols.MemoryRegions: pausing a paused tag or resuming a resident one frees and retakes
    nothing, changes no contents, and leaves a note (torch_memory_saver itself would exit)."""
    kept = {tag: [t.clone() for t in ts] for tag, ts in case.tensors.items()}
    for tag in PAUSE_ORDER:  # every tag resident
        before = case.free()
        with structlog.testing.capture_logs() as logs:
            assert case.regions.resume(tag) == 0, f"a stray resume({tag}) reported bytes"
        assert abs(case.free() - before) <= case.tolerance, f"a stray resume({tag}) took memory"
        assert _noops(logs) == [f"resume({tag})"], f"no note of the stray resume({tag})"
    assert case.regions.paused == frozenset()
    assert all(torch.equal(a, b) for tag in kept for a, b in zip(kept[tag], case.tensors[tag], strict=True))
    for tag in PAUSE_ORDER:
        case.regions.pause(tag)
        before = case.free()
        with structlog.testing.capture_logs() as logs:
            assert case.regions.pause(tag) == 0, f"a second pause({tag}) reported bytes"
        assert abs(case.free() - before) <= case.tolerance, f"a second pause({tag}) freed memory"
        assert _noops(logs) == [f"pause({tag})"], f"no note of the second pause({tag})"
        assert tag in case.regions.paused
    for tag in reversed(PAUSE_ORDER):
        case.regions.resume(tag)
    assert case.regions.paused == frozenset()
    for before, after in zip(kept[Region.DEFAULT], case.tensors[Region.DEFAULT], strict=True):
        assert torch.equal(before, after), "default lost its contents to a second pause"


REGIONS: dict[str, Callable[[RegionsCase], None]] = {
    f.__name__: f
    for f in (
        regions_manage_every_tag,
        pause_frees_what_it_reports_and_resume_retakes_it,
        default_keeps_its_contents,
        views_see_the_resumed_memory,
        resume_keeps_the_addresses,
        the_ledger_refuses_a_second_pause_before_the_adapter_acts,
        tensors_made_later_are_paused_too,
        paused_says_which_tags_are_paused,
        a_second_pause_and_a_stray_resume_are_noops,
    )
}


# ---- RolloutEngine ------------------------------------------------------------------------------


def engine_is_named_and_serves_no_version_before_a_sync(case: EngineCase) -> None:
    engine = case.engine
    assert isinstance(engine, RolloutEngine)
    assert isinstance(engine.name, str) and engine.name
    assert engine.weight_version() is None and engine.is_idle()


def a_sync_serves_its_version(case: EngineCase) -> None:
    case.load(3)
    assert case.engine.weight_version() == 3
    case.serve()
    case.load(4)
    assert case.engine.weight_version() == 4
    case.serve()


def release_is_refused_while_busy_and_releases_nothing(case: EngineCase) -> None:
    """protocols.RolloutEngine.release: "Fails if busy" (SGLang's scheduler asserts idle)."""
    case.load(1)
    seen: list[bool] = []

    def check() -> None:
        seen.append(case.engine.is_idle())
        with pytest.raises(case.refusal):
            case.engine.release(ALL)

    case.while_busy(check)
    assert seen == [False], "is_idle was not False with a request in flight"
    assert case.engine.is_idle()
    case.serve()  # nothing was released


def serving_is_refused_while_its_memory_is_released(case: EngineCase) -> None:
    case.load(1)
    for tags in (WEIGHTS, frozenset({EngineMemory.KV_CACHE})):
        case.engine.release(tags)
        with pytest.raises(case.refusal):
            case.serve()
        case.engine.resume(tags)
        if tags == WEIGHTS:
            case.load(1)  # their contents are gone: a refill comes first (refill_engine_weights)
        case.serve()


def the_version_survives_a_release_and_a_refill_serves_it_again(case: EngineCase) -> None:
    """What recover and a critic-only step read: the version outlives the weights' memory, and a
    push at the same version refills them."""
    case.load(5)
    case.engine.release(ALL)
    assert case.engine.weight_version() == 5
    case.engine.resume(WEIGHTS)
    assert case.engine.weight_version() == 5
    case.load(5)
    case.engine.resume(KV)
    assert case.engine.weight_version() == 5
    case.serve()


def the_lifecycle_drives_two_cycles_on_it(case: EngineCase) -> None:
    """The real order: taken over at construction, weights resumed and pushed, KV resumed for the
    rollout, everything released at the restore."""
    trainer = InMemoryTrainer()
    lifecycle = Lifecycle(
        config=LifecycleConfig(),
        trainer=trainer,
        regions=InMemoryRegions(on_pause={Region.PARAM_BUFFER.value: trainer.drop}),
        engine=case.engine,
        transport=case.transport,
    )
    for step in (1, 2):
        with lifecycle.step():
            lifecycle.pause_grads()
            lifecycle.update_weights()
            lifecycle.drop_params()
            lifecycle.rollout(case.serve)
            lifecycle.restore()
            lifecycle.train(trainer.optimizer_step)
        assert case.engine.weight_version() == lifecycle.weight_version == step
    assert lifecycle.phase is Phase.TRAIN and lifecycle.last_restore_verified


def released_reports_what_release_and_resume_did(case: EngineCase) -> None:
    """protocols.RolloutEngine.released, and the server's own state where it has one."""
    engine = case.engine
    case.load(1)
    steps = [
        (engine.release, KV, KV),
        (engine.release, ALL, ALL),
        (engine.resume, WEIGHTS, KV),
        (engine.resume, KV, frozenset()),
    ]
    for call, tags, expected in steps:
        call(tags)
        assert engine.released() == expected, f"{call.__name__}({sorted(tags)})"
        if case.truth is not None:
            assert case.truth() == expected, f"the server after {call.__name__}({sorted(tags)})"


def a_repeated_release_or_resume_changes_nothing(case: EngineCase) -> None:
    """A release of released memory and a resume of resident memory are no-ops: the weights still
    serve after a no-op resume of them, and the version stands."""
    engine = case.engine
    case.load(2)
    engine.release(KV)
    engine.release(KV)
    assert engine.released() == KV
    engine.resume(WEIGHTS)  # resident: nothing may reallocate (and so lose) them
    assert engine.released() == KV and engine.weight_version() == 2
    engine.resume(ALL)  # weights resident, KV released: only KV comes back
    engine.resume(ALL)
    assert engine.released() == frozenset() and engine.weight_version() == 2
    if case.truth is not None:
        assert case.truth() == frozenset()
    case.serve()  # no sync since: the weights were never released


def a_dead_engine_is_an_engine_error_on_every_call(case: EngineCase) -> None:
    case.load(1)
    case.engine.release(KV)  # so that both memory calls below have something to send
    assert case.kill is not None
    case.kill()
    calls: list[Callable[[], Any]] = [
        lambda: case.engine.release(WEIGHTS),
        lambda: case.engine.resume(KV),
        case.engine.flush_cache,
        case.engine.weight_version,
        case.engine.is_idle,
        lambda: case.load(2),
    ]
    for call in calls:
        with pytest.raises(EngineError):
            call()


def loads_bucket_by_bucket_and_reports_bytes_written(case: EngineCase) -> None:
    """RolloutEngine.update_weights: one bucket per call, bytes written returned, tensors never written;
    `version` served once every weight arrived; an update into released weights refused."""
    engine = case.engine
    assert engine.features.loads_weights
    weights = list(case.weights)
    counters = [t._version for _, t in weights]
    copies = [t.clone() for _, t in weights]
    half = len(weights) // 2
    with case.session(2):
        written = [engine.update_weights(weights[:half], 2), engine.update_weights(weights[half:], 2)]
    bucket_bytes = [sum(nbytes(t) for _, t in weights[:half]), sum(nbytes(t) for _, t in weights[half:])]
    assert written == [case.replicas * b for b in bucket_bytes]
    assert engine.weight_version() == 2
    assert [t._version for _, t in weights] == counters, "update_weights wrote into a tensor it was handed"
    assert all(torch.equal(a, t) for a, (_, t) in zip(copies, weights, strict=True))
    digests = getattr(engine, "digests", lambda: None)()
    if digests is not None:
        from orchestrator.adapters.digest import sha256_digests

        assert digests == sha256_digests(dict(weights))
    engine.release(WEIGHTS)
    with pytest.raises(case.refusal), case.session(3):
        engine.update_weights(weights, 3)
    assert engine.weight_version() == 2


class _Stopped(Exception):
    """The update stopped (the trainer failed between buckets)."""


def a_partial_load_does_not_serve_the_new_version(case: EngineCase) -> None:
    """RolloutEngine.update_weights: "It serves `version` once every weight has arrived at that version",
    and its weight_update_session: never after a session whose body raised. An update that stops after
    its first bucket leaves the engine on the version it had."""
    engine, weights = case.engine, list(case.weights)
    assert engine.features.loads_weights
    case.load(1)
    with contextlib.suppress(_Stopped), case.session(2):
        engine.update_weights(weights[: len(weights) // 2], 2)
        raise _Stopped
    assert engine.weight_version() == 1, "half the weights arrived, and the new version is served"


def unanswered_memory_calls_are_settled_to_what_the_server_did(case: EngineCase) -> None:
    """A release and a resume whose answer was lost (answered late, the connection dropped after
    the server applied it, the server held up before applying it): `released()` reports what the
    server did, and the next release of everything sends nothing twice (a double release would
    end an SGLang server: `truth` asserts every server lives)."""
    import time

    from tests.support.contract_cases import READ_TIMEOUT_S

    engine, truth, fault = case.engine, case.truth, case.fault
    assert truth is not None and fault is not None
    case.load(1)
    for kind in ("late", "drop", "stall"):
        fault(kind, READ_TIMEOUT_S + 0.5)
        with pytest.raises(EngineError):
            engine.release(KV)
        time.sleep(0.6 if kind != "drop" else 0)  # the server has finished with it
        assert truth() == KV, kind
        assert engine.released() == KV, f"{kind}: released() did not settle the release"
        engine.release(ALL)  # what recover does: KV is not sent again
        assert truth() == ALL and engine.released() == ALL
        fault(kind, READ_TIMEOUT_S + 0.5)
        with pytest.raises(EngineError):
            engine.resume(ALL)
        time.sleep(0.6 if kind != "drop" else 0)
        assert engine.released() == truth() == frozenset(), f"{kind}: released() did not settle the resume"
        engine.release(ALL)
        engine.resume(ALL)
        assert truth() == frozenset()
    case.load(2)
    case.serve()


ENGINES: dict[str, Callable[[EngineCase], None]] = {
    f.__name__: f
    for f in (
        engine_is_named_and_serves_no_version_before_a_sync,
        a_sync_serves_its_version,
        release_is_refused_while_busy_and_releases_nothing,
        serving_is_refused_while_its_memory_is_released,
        the_version_survives_a_release_and_a_refill_serves_it_again,
        the_lifecycle_drives_two_cycles_on_it,
        released_reports_what_release_and_resume_did,
        a_repeated_release_or_resume_changes_nothing,
    )
}
ENGINES_THAT_LOAD: dict[str, Callable[[EngineCase], None]] = {
    f.__name__: f
    for f in (loads_bucket_by_bucket_and_reports_bytes_written, a_partial_load_does_not_serve_the_new_version)
}
REMOTE_ENGINES: dict[str, Callable[[EngineCase], None]] = {
    f.__name__: f
    for f in (
        a_dead_engine_is_an_engine_error_on_every_call,
        unanswered_memory_calls_are_settled_to_what_the_server_did,
    )
}


# ---- WeightTransport ----------------------------------------------------------------------------


def _push(case: TransportCase, version: int) -> Any:
    case.forget()
    with case.session(version):
        return case.transport.push(version)


def a_push_delivers_every_tensor_once_with_its_values(case: TransportCase) -> None:
    """protocols.WeightTransport.push: "Send every sync tensor; the engine serves `version` once
    this returns"."""
    assert isinstance(case.transport, WeightTransport)
    for version in (1, 2):  # every step pushes again
        _push(case, version)
        delivered = case.delivered()
        names = [n for n, _ in delivered]
        assert sorted(names) == sorted(case.expected()), "not every sync tensor arrived exactly once"
        expected = case.expected()
        wrong = [n for n, t in delivered if not torch.equal(t, expected[n])]
        assert not wrong, f"arrived with other values: {wrong}"
        assert case.engine.weight_version() == version


def the_report_counts_what_arrived(case: TransportCase) -> None:
    """The TransferReport becomes the span's colocate.tensors, colocate.bytes_moved, colocate.buckets."""
    report = _push(case, 1)
    delivered = case.delivered()
    assert report.tensors == len(delivered)
    assert report.bytes == sum(nbytes(t) for _, t in delivered)
    if case.calls is not None:
        assert report.buckets == case.calls()
    assert report.buckets >= 1


def a_push_never_writes_what_it_reads(case: TransportCase) -> None:
    """protocols.Trainer.sync_tensors: read-only; a write to a view would change the live param."""
    before = [(n, t.clone()) for n, t in case.sources()]
    _push(case, 1)
    after = dict(case.sources())
    assert all(torch.equal(t, after[n]) for n, t in before)


def a_refused_push_raises_and_the_version_is_not_served(case: TransportCase) -> None:
    """Adapters never swallow a failed call: the controller decides (it faults)."""
    _push(case, 1)
    case.refuse()
    with pytest.raises(case.refusal):
        _push(case, 2)
    try:
        served = case.engine.weight_version()
    except case.refusal:  # an engine that died answers nothing
        return
    assert served != 2


TRANSPORTS: dict[str, Callable[[TransportCase], None]] = {
    f.__name__: f
    for f in (
        a_push_delivers_every_tensor_once_with_its_values,
        the_report_counts_what_arrived,
        a_push_never_writes_what_it_reads,
        a_refused_push_raises_and_the_version_is_not_served,
    )
}
