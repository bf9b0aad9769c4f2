"""StorageRegions on real tensors: storages are freed, views survive, `default` keeps contents."""

from __future__ import annotations

import torch

from orchestrator.adapters.storage import StorageRegions
from states import Region


def test_pause_frees_views_follow_and_default_keeps_contents() -> None:
    params = torch.arange(1024, dtype=torch.float32)
    view = params[10:20]
    state = torch.full((256,), 3.0)
    regions = StorageRegions(lambda: {"param_buffer": [params, view], "grad_buffer": [], "default": [state, view]})
    assert regions.pause(Region.PARAM_BUFFER) == 4096, "the shared storage counts once"
    assert regions.resident_bytes()["param_buffer"] == 0
    assert regions.pause(Region.DEFAULT) == 1024, "a storage already under param_buffer is not paused twice"
    regions.resume(Region.PARAM_BUFFER)
    regions.resume(Region.DEFAULT)
    view.fill_(7)
    assert params[15] == 7, "views share the resized storage"
    assert torch.equal(state, torch.full((256,), 3.0)), "default is paused with a backup"


def test_tensors_are_enumerated_at_each_pause() -> None:
    tensors: dict[str, list[torch.Tensor]] = {"param_buffer": [], "grad_buffer": [], "default": []}
    regions = StorageRegions(lambda: tensors)
    tensors["default"].append(torch.ones(8))  # Adam moments appear at the first step
    assert regions.pause(Region.DEFAULT) == 32
