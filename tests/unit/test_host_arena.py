"""The host arena behind paused regions that keep their contents: laid out and pinned once, reused
every cycle, laid out anew only when the storages change; and what the lifecycle reports of it.

On the CPU the arena is a plain host block (`pinned=False`): the layout, the chunked copies and the
reuse are the same code a GPU runs; tests/gpu/test_host_arena_gpu.py pins it under torch_memory_saver.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.adapters.regions.host import HostArena, as_bytes
from orchestrator.adapters.regions.storage import StorageRegions
from orchestrator.telemetry import semconv
from orchestrator.telemetry.listeners import Listener, TransitionRecord
from orchestrator.testing import InMemoryRegions, InMemoryTrainer
from states import Event, Region
from tests.support.rig import cycle, make_rig


def _storages(*sizes: int) -> list[torch.UntypedStorage]:
    return [torch.randint(0, 256, (n,), dtype=torch.uint8).untyped_storage() for n in sizes]


def _snapshot(storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
    return [as_bytes(s).clone() for s in storages]


@pytest.mark.parametrize("chunk", [1, 1000, 1 << 20])
def test_save_then_load_gives_back_every_byte_across_chunk_edges(chunk: int) -> None:
    arena = HostArena(pinned=False, chunk_bytes=chunk)
    storages = _storages(4097, 3, 10_000)
    before = _snapshot(storages)
    assert arena.save(storages) == 4097 + 3 + 10_000
    for s in storages:
        as_bytes(s).fill_(0)
    assert arena.load(storages) == 4097 + 3 + 10_000
    assert all(torch.equal(as_bytes(s), b) for s, b in zip(storages, before, strict=True))


def test_the_arena_is_laid_out_once_and_reused_while_the_storages_stay() -> None:
    arena = HostArena(pinned=False)
    storages = _storages(5000, 7000)
    arena.save(storages)
    block = arena._block
    assert block is not None
    address = block.data_ptr()
    for _ in range(3):
        for s in storages:  # what a step does to the optimizer state
            as_bytes(s).add_(1)
        expected = _snapshot(storages)
        arena.save(storages)
        for s in storages:
            as_bytes(s).fill_(0)
        arena.load(storages)
        assert all(torch.equal(as_bytes(s), e) for s, e in zip(storages, expected, strict=True))
    assert arena.layouts == 1 and arena._block is not None and arena._block.data_ptr() == address
    assert arena.nbytes == 8192 + 8192  # each storage page-aligned


def test_new_storages_lay_the_arena_out_anew_and_drop_the_old_block() -> None:
    arena = HostArena(pinned=False)
    mains = _storages(4096)
    arena.save(mains)
    moments = _storages(4096, 4096)  # the Adam moments appear at the first optimizer step
    arena.save(mains + moments)
    assert arena.layouts == 2 and arena.nbytes == 3 * 4096
    arena.close()
    assert arena.nbytes == 0


def test_load_of_other_storages_is_refused() -> None:
    arena, saved = HostArena(pinned=False), _storages(100)
    arena.save(saved)
    with pytest.raises(RuntimeError, match="other than the ones saved"):
        arena.load(_storages(100))


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostArena(pinned=False, chunk_bytes=0)


def test_storage_regions_on_the_cpu_keep_no_arena() -> None:
    """On the CPU a kept copy would share the RAM it shadows: the copy lives only while paused."""
    optimizer_state = torch.randn(1000)
    regions = StorageRegions(lambda: {Region.DEFAULT.value: [optimizer_state]})
    before = optimizer_state.clone()
    regions.pause(Region.DEFAULT.value)
    regions.resume(Region.DEFAULT.value)
    assert torch.equal(optimizer_state, before)
    assert regions.host_arena_bytes() == 0


class _ArenaRegions(InMemoryRegions):
    """In-memory regions that say they pin a host arena for `default` once it is first paused."""

    def __init__(self, arena: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.arena, self.pinned = arena, 0

    def pause(self, tag: str) -> int:
        if tag == Region.DEFAULT.value:
            self.pinned = self.arena
        return super().pause(tag)

    def host_arena_bytes(self) -> int:
        return self.pinned


class _Records(Listener):
    def __init__(self) -> None:
        self.records: list[TransitionRecord] = []

    def on_transition(self, record: TransitionRecord) -> None:
        self.records.append(record)


def test_the_lifecycle_reports_the_arena_at_pause_and_at_restore() -> None:
    records, trainer = _Records(), InMemoryTrainer()
    regions = _ArenaRegions(1 << 20, on_pause={Region.PARAM_BUFFER.value: trainer.drop})
    rig = make_rig(listeners=(records,), trainer=trainer, regions=regions)
    cycle(rig)
    by_event = {r.event: r.attributes for r in records.records}
    stash = rig.trainer.host_pinned_bytes()
    pause, restore = by_event[Event.PAUSE_GRADS], by_event[Event.RESTORE]
    assert pause[semconv.HOST_PINNED_BYTES] == stash + (1 << 20)
    assert pause[semconv.BYTES_TO_HOST] == pause[semconv.BYTES_STASHED] + (1 << 20)
    assert restore[semconv.HOST_PINNED_BYTES] == stash + (1 << 20)  # kept for the next pause
    assert restore[semconv.BYTES_FROM_HOST] == 1 << 20
