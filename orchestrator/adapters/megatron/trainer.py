"""The Trainer Protocol over what a Megatron-core trainer already has: DDP chunks + optimizer.

Rematerialize rebuilds the bf16 params after their buffer was dropped without a backup, exactly
as they were produced at the end of the optimizer step: each DistributedOptimizer casts its fp32
main shard into the param buffer (`_copy_main_params_to_model_params`), then every chunk
all-gathers the params (`start_param_sync(force_sync=True)`). What the fp32 mains cannot rebuild,
the extras, keeps a small pinned host backup:

- `expert_bias` buffers: module buffers, in no DDP buffer and no optimizer;
- fp32-dtype params: their optimizer "main" is a view of the param buffer itself, so it is
  dropped with it;
- frozen params (`requires_grad=False`): in no DDP buffer and no optimizer.

Backup mode, the baseline, pins a host copy of every param buffer instead.

A stash holds the params as they were at one optimizer step. `StepsBegun` counts the steps as
they begin, by a step pre-hook on each inner torch optimizer, so a step that moved the mains and
then raised (before the cast, or in the all-gather) still counts: a rebuild after it casts from
the mains whatever the mode, and leaves the extras as the step left them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from enum import StrEnum
from typing import Any

import torch

from orchestrator.adapters.digest import DIGESTS, DigestMethod, default_digest
from orchestrator.adapters.megatron.fast_cast import MainParamCast
from orchestrator.adapters.transport.bucketed import nbytes
from orchestrator.errors import ConfigError, StashMismatch
from orchestrator.protocols import TrainerStateFromReads
from orchestrator.telemetry import semconv
from orchestrator.telemetry.tracing import process_span
from states import Mode, Source, TrainerLayout, TrainingSetup


class Extra(StrEnum):
    """The kinds of tensor a cast + all-gather cannot rebuild."""

    EXPERT_BIAS = "expert_bias"
    FP32 = "fp32"
    FROZEN = "frozen"


ALL_EXTRAS = frozenset(Extra)


# TrainingSetup fields that Megatron's own configs decide: read, never taken from the caller.
MEGATRON_HOLDS = frozenset(
    {
        "distributed_optimizer",
        "overlap_param_gather",
        "optimizer_disabled",
        "precision_aware_optimizer",
        "optimizer_cpu_offload",
    }
)


def megatron_setup(chunks: Sequence[Any], optimizer: Any, **flags: bool) -> TrainingSetup:
    """The `TrainingSetup` facts Megatron's own configs hold; `flags` give the trainer's others
    (colocate, offload_train, compute_advantages, lora, keep_old_actor, debug_train_only).

    Raises ConfigError, naming them, for flags that Megatron's configs hold (the DDP config and
    the optimizer config are the truth; change them, not the setup) and for unknown flags.
    """
    problems = [
        f"{name}: read from Megatron's DDP and optimizer configs, not given"
        for name in sorted(flags.keys() & MEGATRON_HOLDS)
    ]
    known = set(TrainingSetup.__dataclass_fields__)
    problems += [f"{name}: not a TrainingSetup flag" for name in sorted(flags.keys() - known)]
    if problems:
        raise ConfigError(problems)
    ddp = [chunk.ddp_config for chunk in chunks]
    configs = [o.config for o in getattr(optimizer, "chained_optimizers", [optimizer]) if o is not None]
    return TrainingSetup(
        distributed_optimizer=all(c.use_distributed_optimizer for c in ddp),
        overlap_param_gather=any(c.overlap_param_gather for c in ddp),
        optimizer_disabled=not configs,
        precision_aware_optimizer=any(c.use_precision_aware_optimizer for c in configs),
        optimizer_cpu_offload=any(c.optimizer_cpu_offload for c in configs),
        **flags,
    )


def _strip(name: str) -> str:
    """`module.module.decoder...` (DDP → Float16Module → GPTModel) → `decoder...`."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(?=\.)")


def _global_experts(chunk: Any) -> Callable[[str], str]:
    """`...local_experts.<local>...` → `...local_experts.<global>...`: under expert parallelism
    every rank numbers its own experts from 0, so only the global index names one expert."""
    config = getattr(chunk, "config", None)
    experts = getattr(config, "num_moe_experts", None) or 0
    if not experts:
        return lambda name: name
    from megatron.core import parallel_state

    size = parallel_state.get_expert_model_parallel_world_size()
    offset = parallel_state.get_expert_model_parallel_rank() * (experts // size)
    return lambda name: _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + offset}", name)


def _router_dtype(buffer: torch.Tensor) -> None:
    """Megatron's router turns `expert_bias` into fp32 at its first forward (after Float16Module
    cast it to bf16). Do it now, so that its backup has that dtype from the first stash on."""
    if buffer.dtype != torch.float32:
        buffer.data = buffer.data.to(torch.float32)


class StepsBegun:
    """How many optimizer steps have begun to change the fp32 mains, counted from the optimizers
    themselves: a step pre-hook on each inner torch optimizer (`torch.optim.AdamW` on the CPU,
    TE's or apex's `FusedAdam` on a GPU, all `torch.optim.Optimizer`s) runs before the update,
    so a step that raises after it counts. The hooks are this instance's: nothing process-wide
    is changed. Every inner optimizer's step counts: one per step where Megatron chains one
    optimizer, one per chained optimizer where it chains several (dense and expert params).
    """

    def __init__(self, optimizers: Sequence[Any]) -> None:
        self.count = 0
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", None)
            if inner is None:
                continue  # a stub: no params on this rank, so no mains to change
            if not isinstance(inner, torch.optim.Optimizer):
                raise ConfigError([f"{type(inner).__name__}: not a torch optimizer, its steps cannot be counted"])
            inner.register_step_pre_hook(self._begin)

    def _begin(self, *_: object) -> None:
        self.count += 1


def _extra_kind(param: torch.Tensor, extras: Collection[Extra]) -> Extra | None:
    if not param.requires_grad and Extra.FROZEN in extras:
        return Extra.FROZEN
    if param.dtype == torch.float32 and Extra.FP32 in extras:
        return Extra.FP32
    return None


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _host_like(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)


def _named(
    chunks: Sequence[Any], buffers: Sequence[Any], extras: Collection[Extra]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Source]]:
    """Every param of `chunks` by its global name (experts numbered across EP ranks, virtual
    stages prefixed), the extras among them and the `expert_bias` buffers, and where each is
    rebuilt from after a drop."""
    in_buffers = {id(p) for b in buffers for p in b.params}
    params: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    sources: dict[str, Source] = {}
    for i, chunk in enumerate(chunks):
        prefix, globally = (f"vp_stages.{i}." if len(chunks) > 1 else ""), _global_experts(chunk)
        for raw, param in chunk.named_parameters():
            name = prefix + globally(_strip(raw))
            params[name] = param
            kind = _extra_kind(param, extras)
            if kind is not None:
                kept[name] = param
            # An fp32 param is in a DDP buffer, but its "main" is a view of that buffer: a
            # drop loses it unless it is an extra. Left out, it is uncovered, by name.
            rebuilt = id(param) in in_buffers and param.dtype != torch.float32
            sources[name] = Source.EXTRAS if kind else Source.PARAM_BUFFER if rebuilt else Source.ELSEWHERE
        for raw, buffer in chunk.named_buffers():
            if raw.endswith("expert_bias"):
                name = prefix + globally(_strip(raw))
                _router_dtype(buffer)
                covered = Extra.EXPERT_BIAS in extras
                if covered:
                    kept[name] = buffer
                sources[name] = Source.EXTRAS if covered else Source.ELSEWHERE
    return params, kept, sources


class MegatronTrainer(TrainerStateFromReads):
    """Implements `orchestrator.protocols.Trainer` for Megatron-core DDP + DistributedOptimizer.

    `chunks` are the `DistributedDataParallel` model chunks (one per virtual pipeline stage);
    `optimizer` is the (chained) optimizer `get_megatron_optimizer` returned. `extras` chooses
    which kinds of extra are backed up; leaving one out makes any such param uncovered, which
    the lifecycle refuses at init. `digest` proves verified restores; None takes
    `default_digest` of the params' device (the device digest on a GPU, SHA256 on the CPU).
    """

    def __init__(
        self,
        chunks: Sequence[Any],
        optimizer: Any,
        *,
        extras: Collection[Extra] = ALL_EXTRAS,
        digest: DigestMethod | None = None,
    ) -> None:
        self._chunks = list(chunks)
        self._optimizers = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        # Newer Megatron lists every buffer (gtp/egtp ones too) in `all_buffers`.
        self._buffers = [
            b for c in self._chunks for b in getattr(c, "all_buffers", [*c.buffers, *c.expert_parallel_buffers])
        ]
        self._pin = torch.cuda.is_available()
        self._params, self._extras, self._sources = _named(self._chunks, self._buffers, extras)
        where = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self.digest_method = DigestMethod(digest) if digest is not None else default_digest(where)
        self._digest = DIGESTS[self.digest_method]
        self._extra_backup: dict[str, torch.Tensor] = {}
        self._param_backup: list[torch.Tensor] = []
        self._steps = StepsBegun(self._optimizers)
        self._stashed_at: int | None = None  # the step count the stash was taken at
        self.cast = MainParamCast(self._optimizers)  # one Triton launch where it can, else Megatron's loop

    # ---- the Trainer Protocol -------------------------------------------------------------

    def layout(self) -> TrainerLayout:
        rebuilt = [n for n, s in self._sources.items() if s is Source.PARAM_BUFFER and n in self._params]
        return TrainerLayout(
            sync_sources=self._sources,
            uncovered=tuple(n for n, s in self._sources.items() if s is Source.ELSEWHERE),
            param_bytes=sum(nbytes(self._params[n]) for n in rebuilt),
            params=sum(p.numel() for p in self._params.values()),
            extras_bytes=sum(nbytes(t) for t in self._extras.values()),
        )

    def stash(self, mode: Mode) -> int:
        """Copy the extras (and, in backup mode, the param buffers) to host memory, and note the
        step count they belong to (`mains_generation`)."""
        self._stashed_at = None  # a stash that raises midway is never trusted
        copied = 0
        for name, tensor in self._extras.items():
            backup = self._extra_backup.get(name)
            if backup is None:
                backup = self._extra_backup[name] = _host_like(tensor, self._pin)
            elif (backup.dtype, backup.shape) != (tensor.dtype, tensor.shape):
                raise StashMismatch(
                    name, f"{backup.dtype} {list(backup.shape)}", f"{tensor.dtype} {list(tensor.shape)}"
                )
            backup.copy_(tensor.detach())
            copied += nbytes(tensor)
        if mode is Mode.BACKUP:
            if not self._param_backup:
                self._param_backup = [_host_like(b.param_data, self._pin) for b in self._buffers]
            for backup, buffer in zip(self._param_backup, self._buffers, strict=True):
                backup.copy_(buffer.param_data, non_blocking=True)
                copied += nbytes(buffer.param_data)
        _synchronize()
        self._stashed_at = self.mains_generation()
        return copied

    def rebuild(self, mode: Mode) -> int:
        """Make the params cast(mains): backup mode copies the stash back, rematerialize casts
        and gathers, and both copy the extras back. A stash older than the last step begun (or
        none) is stale: the params are cast and gathered whatever the mode, and the extras,
        which that step found resident and may have changed, stay as they are."""
        written = 0
        current = self._stashed_at == self.mains_generation()
        if mode is Mode.BACKUP and current:
            for backup, buffer in zip(self._param_backup, self._buffers, strict=True):
                buffer.param_data.copy_(backup, non_blocking=True)
                written += nbytes(buffer.param_data)
        else:
            with process_span(semconv.CAST_SPAN):
                self.cast_mains()
            with process_span(semconv.GATHER_SPAN):
                self.gather_params()
            written += sum(nbytes(b.param_data) for b in self._buffers)
        if current:
            with process_span(semconv.EXTRAS_SPAN):
                written += self.copy_extras_back()
        # The grad buffers come back holding whatever the resumed pages held: Megatron's train
        # step zeroes them (`zero_grad_buffer`) before accumulating, so they are not restored.
        _synchronize()
        return written

    def digests(self) -> Mapping[str, str]:
        with process_span(semconv.DIGEST_SPAN, {semconv.TENSORS: len(self._params) + len(self._extras)}):
            return self._digest({**self._params, **self._extras})

    def sync_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Read-only (the Trainer Protocol): params are views of the resident param buffer;
        extras are copies of their backup, made here, so that a transport writing to what it
        was handed cannot change what the next restore copies back."""
        for name, source in self._sources.items():
            if source is Source.EXTRAS:
                backup = self._extra_backup.get(name)
                if backup is None:
                    raise LookupError(f"{name} is an extra with no backup yet: stash first (pause_grads does)")
                yield name, backup.clone()
            elif source is Source.PARAM_BUFFER:
                yield name, self._params[name].detach()
            else:
                raise LookupError(f"{name} is in neither a param buffer nor the extras backup")

    def host_pinned_bytes(self) -> int:
        return sum(nbytes(t) for t in (*self._extra_backup.values(), *self._param_backup))

    def mains_generation(self) -> int:
        """Optimizer steps begun (`StepsBegun`), a step that raised midway included."""
        return self._steps.count

    def sync_shapes(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync tensors' names, shapes and dtypes, as tensors on the meta device: to check a
        conversion before anything is stashed, paused or sent."""
        tensors = {**self._params, **self._extras}
        for name in self._sources:
            if name in tensors:  # an uncovered buffer is no sync tensor: the lifecycle refuses it at init
                yield name, torch.empty(tensors[name].shape, dtype=tensors[name].dtype, device="meta")

    # ---- the steps of a rematerialize restore, timed apart by the benchmark -----------------

    def cast_mains(self) -> None:
        """fp32 main shard → bf16 param buffer shard, in every DistributedOptimizer (`fast_cast`)."""
        self.cast()

    def gather_params(self) -> None:
        """All-gather every chunk's param buffers over their (expert) data-parallel groups."""
        for chunk in self._chunks:
            groups = getattr(chunk, "all_bucket_groups", [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups])
            if all(group.intra_distributed_optimizer_instance_size == 1 for group in groups):
                continue  # this rank owns every shard: there is nothing to gather
            chunk.start_param_sync(force_sync=True)

    def copy_extras_back(self) -> int:
        for name, tensor in self._extras.items():
            tensor.data.copy_(self._extra_backup[name], non_blocking=True)
        return sum(nbytes(t) for t in self._extras.values())

    # ---- what the memory regions manage --------------------------------------------------

    def region_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors behind each region tag: param and grad buffers, and the optimizer state.

        `default` lists the fp32 main shards and the Adam moments. Storages shared with the
        param buffer (the "mains" of fp32 params are views of it) stay in `param_buffer`.
        """
        state: list[torch.Tensor] = []
        for optimizer in self._optimizers:
            for group in getattr(optimizer, "shard_fp32_from_float16_groups", []):
                state.extend(group)
            inner = getattr(optimizer, "optimizer", None)
            for per_param in getattr(inner, "state", {}).values():
                state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {
            "param_buffer": [b.param_data for b in self._buffers],
            "grad_buffer": [b.grad_data for b in self._buffers],
            "default": state,
        }

    def region_bytes(self) -> dict[str, int]:
        """Bytes each region tag holds once the optimizer has stepped (`steady_region_bytes`)."""
        return steady_region_bytes(self.region_tensors(), self._optimizers)


def steady_region_bytes(tensors: Mapping[str, Sequence[torch.Tensor]], optimizers: Sequence[Any]) -> dict[str, int]:
    """Bytes each region tag holds once the optimizer has stepped: the buffers as they are, and
    `default` as Adam's (Megatron's default optimizer): two moments the size of every fp32 shard
    it updates, besides the mains of the bf16 params (those of fp32 params are views of the param
    buffer). The moments exist from set-up where `build.init_optimizer_state` made them, else
    from the first step; where they exist, what is held."""
    from orchestrator.adapters.regions.storage import storages_by_tag

    held = {tag: sum(s.nbytes() for s in storages) for tag, storages in storages_by_tag(tensors).items()}

    def shard_bytes(groups: str) -> int:
        return sum(t.numel() * t.element_size() for o in optimizers for g in getattr(o, groups, []) for t in g)

    mains = shard_bytes("shard_fp32_from_float16_groups")
    held["default"] = max(held["default"], 3 * mains + 2 * shard_bytes("shard_fp32_groups"))
    return held
