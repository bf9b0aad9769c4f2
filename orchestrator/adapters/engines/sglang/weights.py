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
from orchestrator.telemetry.logs import note_leftover

# sglang 0.5.23's answer to a /begin_weight_update while a session is open (SchedulerWeightUpdaterManager).
_ALREADY_OPEN = "a weight-update session is already open"
# Its answer to /destroy_weights_update_group for a name it has no group of (model runner's weight_updater.py).
_NO_GROUP = "The group to be destroyed does not exist"


class SGLangWeightUpdates(SGLangHTTP):
    """The weight-update routes of one server; a bucket is `tp_size` payloads (one per TP rank)."""

    tp_size: int

    def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session; 0.5.23's scheduler refuses every
        /update_weights_from_tensor and /update_weights_from_distributed outside one.

        A session already open was left by a run that ended inside its update (a killed
        trainer; a live one closes its session on every failure): it is closed and opened
        afresh, with a `leftover` warning line, since this update replaces every weight."""
        try:
            self._call("POST", "/begin_weight_update", {})
        except EngineError as exc:
            if _ALREADY_OPEN not in exc.reason:
                raise
            self.end_weight_update()
            note_leftover(self.name, "a weight-update session left open", "closed it and opened a new one")
            self._call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> None:
        """Close the session (SGLang finalizes the loaded weights here)."""
        self._call("POST", "/end_weight_update", {})

    def set_weight_version(self, version: int) -> None:
        """Serve `version` from now on: POST /update_weight_version. `abort_all_requests` is false
        (SGLang's default, true, would abort every request in flight): generation is paused or
        idle around an update, and a request that runs on is the caller's choice (`--engine-pause`).

        SGLang 0.5.23 records the version in the tokenizer manager (what /model_info and each
        answer's `meta_info.weight_version` report) and in the scheduler
        (`Scheduler.handle_update_weight_version`), whatever it was before: it never checks that
        versions go up, so colocate sends it once per update, after the update succeeded."""
        self._call("POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    @contextmanager
    def weight_update_session(self, version: int | None = None) -> Iterator[None]:
        """The session around the body: on a clean exit it is closed and then, if `version` is
        given, the server serves it (`set_weight_version`); if the body raised, it is closed and
        the version served stays the old one. None leaves the version as it is."""
        self.begin_weight_update()
        try:
            yield
        except BaseException as exc:
            _close_quietly([self], exc)
            raise
        self.end_weight_update()
        if version is not None:
            self.set_weight_version(version)

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """Send one bucket of HF-named tensors, every TP rank's payload serialized here; returns
        the bucket's bytes (once, whatever `tp_size`). For one process that holds every weight
        and feeds every TP rank (a trainer of one rank, a test): each TP rank maps this process's
        memory. Trainer ranks on the server's GPUs each serialize the bucket from their own memory
        and post with `update_weights_from_payloads` instead (`job.workers.transports.PerTpRankPush`).

        The bucket carries no `weight_version`: SGLang would serve it from this bucket on, with
        the model part-updated (0.5.23 records the version of every successful update that
        carries one), so the version moves once, at the session's clean close
        (`weight_update_session`). `version` is the `BucketSink` signature's; it is not sent.

        The flattened tensor stays referenced until SGLang answers: its CUDA IPC handle is only
        valid while this process holds the memory.
        """
        bucket = flattened_bucket(named)
        self.update_weights_from_payloads([serialize(bucket) for _ in range(self.tp_size)])
        return int(bucket["flattened_tensor"].numel())

    def update_weights_from_payloads(self, payloads: Sequence[str]) -> None:
        """Post one flattened bucket as `payloads`, one per TP rank in rank order: SGLang's TP
        rank i unpickles entry i alone (0.5.23's `TpModelWorker`), so each entry may come from the
        process whose GPU that rank shares (`wire.serialize` of `wire.flattened_bucket`).
        Whoever serialized an entry holds its memory until this returns (a CUDA IPC handle or a
        shared-memory file is only valid while held). No `weight_version` (see `update_weights`),
        and the cache is not flushed here (`flush_cache=False`): colocate flushes once after the
        last bucket, under the `cache_flushed` guard."""
        if len(payloads) != self.tp_size:
            raise ValueError(f"{self.name}: {len(payloads)} payloads for {self.tp_size} TP ranks (one per rank)")
        self._call(
            "POST",
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": list(payloads),
                "load_format": "flattened_bucket",
                "flush_cache": False,
            },
        )

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

    def destroy_weights_update_group(self, group_name: str) -> bool:
        """End the server's end of the group `group_name`: True if it had one, False if it had
        none (sglang 0.5.23 answers 400, "The group to be destroyed does not exist.")."""
        try:
            self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})
        except EngineError as exc:
            if _NO_GROUP in exc.reason:
                return False
            raise
        return True

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
        them. `flattened`: one uint8 broadcast laid out as `flattened_bucket` lays it out. Like a
        bucket (`update_weights`), it carries no `weight_version`; `version` is not sent."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
        body = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
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


def _destroy_group_quietly(engines: Sequence[SGLangWeightUpdates], group_name: str) -> None:
    """Destroy the weight-update group `group_name` on each server that has one; a server that
    fails to is a `leftover` warning line, not raised (the next start clears what it left)."""
    for engine in engines:
        try:
            engine.destroy_weights_update_group(group_name)
        except EngineError as exc:
            note_leftover(engine.name, f"the weight-update group {group_name!r}", f"not destroyed: {exc.reason}")
