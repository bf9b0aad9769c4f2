"""StorageRegions on real tensors: storages are freed, views survive, `default` keeps contents."""

from __future__ import annotations

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
