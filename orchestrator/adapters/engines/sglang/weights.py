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

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session; 0.5.23's scheduler refuses every
        /update_weights_from_tensor and /update_weights_from_distributed outside one."""
        self._call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> None:
        """Close the session (SGLang finalizes the loaded weights here)."""
        self._call("POST", "/end_weight_update", {})

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
        """Send one bucket of HF-named tensors, tagged `version`; returns the bytes sent.

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
                "weight_version": str(version),
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
        them. `flattened`: one uint8 broadcast laid out as `flattened_bucket` lays it out."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
        body = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
            "weight_version": str(version),
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        self._call("POST", "/update_weights_from_distributed", body)


def _close_quietly(engines: Sequence[SGLangWeightUpdates], error: BaseException) -> None:
    """End each server's session while `error` is on its way out: it stays the one raised, and
    a server that also refused to close is a note on it."""
    for engine in engines:
        try:
            engine.end_weight_update()
        except EngineError as exc:
            error.add_note(f"and the weight-update session stayed open: {exc}")
