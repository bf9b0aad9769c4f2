"""SGLang's weight-update routes: the session around an update, a bucket by CUDA IPC, and the
metadata of a bucket the trainer broadcasts (see client.py for the routes as sglang 0.5.23 defines them)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from orchestrator.adapters.engines.sglang.http import SGLangHTTP
from orchestrator.adapters.engines.sglang.wire import flattened_bucket, serialize
from orchestrator.errors import EngineError
from orchestrator.protocols import Named


class SGLangWeightUpdates(SGLangHTTP):
    """The weight-update routes of one server; `tp_size` payloads per bucket (one per TP rank)."""

    tp_size: int
    # Which bucket carries `weight_version` (see `_version_tag`): the model's weight names, learned
    # from the first update whose session closed cleanly, and the names arrived at `_arriving`.
    _weight_names: frozenset[str] | None = None
    _arriving: int | None = None
    _arrived: frozenset[str] = frozenset()

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session; 0.5.23's scheduler refuses every
        /update_weights_from_tensor and /update_weights_from_distributed outside one."""
        self._call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> None:
        """Close the session (SGLang finalizes the loaded weights here). The first session that
        closes with weights loaded names the model's weights (see `_version_tag`)."""
        self._call("POST", "/end_weight_update", {})
        if self._weight_names is None and self._arrived:
            self._weight_names = self._arrived

    def _version_tag(self, names: Sequence[str], version: int) -> str | None:
        """The `weight_version` this bucket carries: `str(version)` on the bucket that completes the
        model's weights at `version`, None (SGLang keeps the version it serves) on the others.

        SGLang 0.5.23 moves the version it serves on any successful update that carries one, and
        only then: `TokenizerControlMixin.update_weights_from_tensor` and
        `update_weights_from_distributed` (sglang/srt/managers/tokenizer_control_mixin.py, the value
        /model_info reports) call `_update_weight_version_if_provided` only when the update
        succeeded and its `weight_version` is not None; the scheduler's
        `Scheduler.record_weight_version_change` (scheduler.py) returns on None; io_struct.py's
        `UpdateWeightsFromTensorReqInput` and `UpdateWeightsFromDistributedReqInput` default it to
        None. Tagging only the completing bucket keeps `LoadsWeights`' promise: an update that stops
        early leaves the old version served.

        Until the model's weight names are known (the first update after construction), every
        bucket carries the version: the engine serves nothing colocate synced before it.
        """
        if version != self._arriving:
            self._arriving, self._arrived = version, frozenset()
        self._arrived = self._arrived.union(names)
        if self._weight_names is None or self._arrived >= self._weight_names:
            return str(version)
        return None

    def _abandon_update(self) -> None:
        """Forget the names arrived so far: the update failed, and its retry starts over."""
        self._arriving, self._arrived = None, frozenset()

    @contextmanager
    def weight_update_session(self) -> Iterator[None]:
        """The session around the body; closed whether the body returned or raised."""
        self.begin_weight_update()
        try:
            yield
        except BaseException as exc:
            _close_quietly([self], exc)
            raise
        self.end_weight_update()

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """Send one bucket of HF-named tensors at `version`; returns the bytes sent. SGLang serves
        `version` once the bucket that completes the model's weights arrived (`_version_tag`).

        The flattened tensor stays referenced until SGLang answers: its CUDA IPC handle is only
        valid while this process holds the memory. The cache is not flushed here (`flush_cache=False`):
        colocate flushes once after the last bucket, under the `cache_flushed` guard.
        """
        bucket = flattened_bucket(named)
        payloads = [serialize(bucket) for _ in range(self.tp_size)]
        self._call(
            "POST",
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": payloads,
                "load_format": "flattened_bucket",
                "flush_cache": False,
                "weight_version": self._version_tag([name for name, _ in named], version),
            },
        )
        return int(bucket["flattened_tensor"].numel())

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's broadcast group (engines outside the trainer's GPUs)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._call("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        version: int,
        *,
        flattened: bool = False,
    ) -> None:
        """Announce tensors the trainer broadcasts over `group_name`; returns once SGLang received
        them. `flattened`: one uint8 broadcast laid out as `flattened_bucket` lays it out. SGLang
        serves `version` once the announcement that completes the model's weights succeeded."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
        body = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
            "weight_version": self._version_tag(names, version),
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        self._call("POST", "/update_weights_from_distributed", body)


def _close_quietly(engines: Sequence[SGLangWeightUpdates], error: BaseException) -> None:
    """End each server's session while `error` is on its way out: it stays the one raised, and
    a server that also refused to close is a note on it."""
    for engine in engines:
        engine._abandon_update()
        try:
            engine.end_weight_update()
        except EngineError as exc:
            error.add_note(f"and the weight-update session stayed open: {exc}")
