"""StorageRegions on real tensors: storages are freed, views survive, `default` keeps contents."""

from __future__ import annotations

import pytest
import structlog
import torch

from orchestrator.adapters.regions.storage import StorageRegions
from states import Region


def test_pause_frees_views_follow_and_default_keeps_contents() -> None:
    params = torch.arange(1024, dtype=torch.float32)
    view = params[10:20]
    state = torch.full((256,), 3.0)
    regions = StorageRegions(lambda: {"param_buffer": [params, view], "grad_buffer": [], "default": [state, view]})
    assert regions.pause(Region.PARAM_BUFFER) == 4096, "the shared storage counts once"
    assert regions.resident_bytes()["param_buffer"] == 0
    assert regions.resident_bytes()["default"] == 1024, "a storage already under param_buffer counts once"
    assert regions.pause(Region.DEFAULT) == 0, "on the CPU, default's backup lives in the RAM it would free"
    assert regions.resident_bytes()["default"] == 0
    regions.resume(Region.PARAM_BUFFER)
    regions.resume(Region.DEFAULT)
    view.fill_(7)
    assert params[15] == 7, "views share the resized storage"
    assert torch.equal(state, torch.full((256,), 3.0)), "default is paused with a backup"


def test_tensors_are_enumerated_at_each_pause() -> None:
    tensors: dict[str, list[torch.Tensor]] = {"param_buffer": [], "grad_buffer": [], "default": []}
    regions = StorageRegions(lambda: tensors, keep_contents=())
    tensors["default"].append(torch.ones(8))  # Adam moments appear at the first step
    assert regions.pause(Region.DEFAULT) == 32


def test_freed_counts_what_the_memory_got_back() -> None:
    """Without a backup the storage's bytes are freed; with one in the same RAM, none are."""
    grads, state = torch.zeros(256), torch.ones(512)
    regions = StorageRegions(lambda: {"param_buffer": [], "grad_buffer": [grads], "default": [state]})
    assert regions.pause(Region.GRAD_BUFFER) == 1024
    assert regions.pause(Region.DEFAULT) == 0
    assert regions.resume(Region.DEFAULT) == 0
    assert regions.resume(Region.GRAD_BUFFER) == 1024
    assert torch.equal(state, torch.ones(512))


def _unresizable(nbytes: int) -> torch.Tensor:
    """A tensor over memory torch did not allocate: its storage refuses `resize_`, for real."""
    return torch.frombuffer(bytearray(nbytes), dtype=torch.float32)


def _retake_fails(tensor: torch.Tensor) -> None:
    """Make the next reallocation of `tensor`'s storage raise as an allocator out of memory does.

    Replaced: that one storage object's `resize_` (torch keeps one Python object per storage),
    the very call `resume` makes, and only when it grows; freeing still runs torch's own. The
    override removes itself, so the next resume meets torch's `resize_` again."""
    storage = tensor.untyped_storage()
    real = storage.resize_

    def resize_(nbytes: int) -> torch.UntypedStorage:
        if nbytes:
            del storage.resize_
            raise torch.OutOfMemoryError(f"injected: cannot allocate {nbytes} bytes")
        return real(nbytes)

    storage.resize_ = resize_  # type: ignore[method-assign]


def test_a_pause_that_raised_midway_leaves_the_tag_paused_with_what_it_freed() -> None:
    """The second storage refuses to be freed: the first one is freed already, so the tag is
    paused, and a resume gives it back with its contents (`default` keeps them)."""
    state, foreign = torch.arange(256, dtype=torch.float32), _unresizable(1024)
    regions = StorageRegions(lambda: {"param_buffer": [], "grad_buffer": [], "default": [state, foreign]})
    with pytest.raises(RuntimeError, match="not resizable"):
        regions.pause(Region.DEFAULT)
    assert regions.paused == {Region.DEFAULT}
    assert state.untyped_storage().nbytes() == 0, "the first storage was freed before the second raised"
    with structlog.testing.capture_logs() as logs:
        assert regions.pause(Region.DEFAULT) == 0
    assert [log["call"] for log in logs if log["event"] == "noop"] == ["pause(default)"]
    regions.resume(Region.DEFAULT)
    assert regions.paused == frozenset()
    assert torch.equal(state, torch.arange(256, dtype=torch.float32))


def test_a_pause_that_raised_before_freeing_leaves_the_tag_resident() -> None:
    grads = torch.ones(64)
    regions = StorageRegions(lambda: {"param_buffer": [], "grad_buffer": [_unresizable(256), grads], "default": []})
    with pytest.raises(RuntimeError, match="not resizable"):
        regions.pause(Region.GRAD_BUFFER)
    assert regions.paused == frozenset()
    assert torch.equal(grads, torch.ones(64)), "nothing was freed"


def test_a_resume_that_ran_out_of_memory_midway_stays_paused_until_a_resume_retakes_the_rest() -> None:
    """`resize_` of the second storage raises (out of memory): the tag stays paused, its
    contents are not back; the next resume retakes only the storage still freed, then copies
    every kept byte back."""
    first, second = torch.full((256,), 1.0), torch.full((128,), 2.0)
    regions = StorageRegions(lambda: {"param_buffer": [], "grad_buffer": [], "default": [first, second]})
    regions.pause(Region.DEFAULT)
    _retake_fails(second)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        regions.resume(Region.DEFAULT)
    assert regions.paused == {Region.DEFAULT}, "a storage of the tag is still freed"
    assert first.untyped_storage().nbytes() == 1024 and second.untyped_storage().nbytes() == 0
    assert regions.resume(Region.DEFAULT) == 0, "on the CPU, default's memory gave nothing back to retake"
    assert regions.paused == frozenset()
    assert torch.equal(first, torch.full((256,), 1.0)) and torch.equal(second, torch.full((128,), 2.0))


def test_a_resume_that_raised_at_its_first_storage_retook_nothing() -> None:
    grads = torch.zeros(256)
    regions = StorageRegions(lambda: {"param_buffer": [], "grad_buffer": [grads], "default": []})
    assert regions.pause(Region.GRAD_BUFFER) == 1024
    _retake_fails(grads)
    with pytest.raises(torch.OutOfMemoryError):
        regions.resume(Region.GRAD_BUFFER)
    assert regions.paused == {Region.GRAD_BUFFER} and grads.untyped_storage().nbytes() == 0
    assert regions.resume(Region.GRAD_BUFFER) == 1024, "what this call retook"
    assert regions.paused == frozenset() and grads.untyped_storage().nbytes() == 1024


def test_a_stray_resume_is_a_noop_with_a_note() -> None:
    grads = torch.ones(64)
    regions = StorageRegions(lambda: {"param_buffer": [], "grad_buffer": [grads], "default": []})
    with structlog.testing.capture_logs() as logs:
        assert regions.resume(Region.GRAD_BUFFER) == 0
    assert [(log["component"], log["call"], log["why"]) for log in logs] == [
        ("storage regions", "resume(grad_buffer)", "not paused")
    ]
    assert torch.equal(grads, torch.ones(64))
