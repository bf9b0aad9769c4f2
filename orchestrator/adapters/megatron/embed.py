"""One call from a Megatron-core trainer's model and optimizer to a `Lifecycle`.

This module wires the adapters into the controller, so it sits above both (the controller and
the adapters know each other only through `orchestrator.protocols`); that is also why the call
is a function here and not a `Lifecycle.for_megatron` classmethod, which would make the
controller import Megatron's adapters.

    lifecycle = colocate_megatron(model, optimizer, engine)                 # rematerialize
    lifecycle = colocate_megatron(model, optimizer, engine, Mode.BACKUP)
    lifecycle = colocate_megatron(model, optimizer, None, Mode.TRAIN_ONLY)

`model` is what Megatron calls the model: the list of `DistributedDataParallel` chunks (one per
virtual pipeline stage) that `get_megatron_optimizer` took. What the call chooses, and the
argument that replaces each choice:

| part | chosen | replaced by |
| --- | --- | --- |
| trainer | `MegatronTrainer(model, optimizer)`: expert_bias, fp32 and frozen params are extras | `extras=` |
| regions | torch_memory_saver where the param buffers are on a GPU, storage resizing on the CPU | `memory=Memory(regions=)` |
| setup | read from the DDP and optimizer configs (`megatron_setup`); the trainer's other flags as keywords | `**flags` |
| transport | `MegatronTransport` through `hf_buckets` (`orchestrator.adapters.megatron.convert`): Megatron GPT → HF at any TP, PP and EP, the family read from the config (`family_of`); only sync sources send (`is_sync_source`) | `sync=Sync(convert=)`, `sync=Sync(transport=)` |
| listeners | spans to the trainer's global tracer provider, else to one the `OTEL_*` variables ask for (set as the global one: `otel_listeners`); structlog lines | `listeners=` |
| rank | torch.distributed's | `rank=` |
| checkpoints | none saved, none loaded | `checkpoint=Checkpoint(save_dir=, save_every=, resume=, state=)` |

On a CUDA-less host it applies `enable_cpu_path()` (idempotent): the restore's cast and
all-gather run Megatron code that assumes CUDA. Building the model needs it too, so call it
yourself before you build.

Every rank of the model makes the call, with its handle on the one engine they share (an SGLang
server over their GPUs, say). The conversion's gathers are collectives, so every rank runs each
sync; only one rank per pipeline stage sends (`is_sync_source`: tensor-, data- and
context-parallel rank 0). Every push starts and ends in an all-reduce over the default group: no
stage sends before every rank has resumed the engine's weights, no rank reads the engine's version
before the last stage has sent, and a send that fails on one rank fails the update on every rank
(`PeerPushFailed` on the others), each lifecycle `FAULTED`. The engine's memory calls are made on
every rank: a shared engine's handle must take them once (this module does not choose a rank).
An engine replica per rank (each rank's own, loading the whole model) is not what this wires: a
rank that is no source would leave its replica empty, and its update fails naming the version the
replica serves. Pass `sync=Sync(transport=)` for that layout.

Checkpoints (`orchestrator.adapters.megatron.checkpointing`): with
`checkpoint=Checkpoint(save_every=N, save_dir=DIR)`, every step numbered a multiple of N ends with
a collective save of the model, the optimizer, the RNG and `state()` (rank 0's call: the
trainer's own JSON-able state, its sampler's position say) into DIR/step-N/. With `resume=DIR`,
the last complete checkpoint there is loaded before anything else is built, and the resume point
is `lifecycle.checkpointer.resumed`:

    ckpt = Checkpoint(save_dir=DIR, save_every=100, resume=DIR)
    lifecycle = colocate_megatron(model, optimizer, engine, checkpoint=ckpt)
    point = lifecycle.checkpointer.resumed      # ResumePoint: step, weight_version, state, path, resharded
    for step in range(point.step + 1, last + 1):
        with lifecycle.step(step): ...          # number the steps: a save is named by its step

Nothing moves before every check has passed: a setup Megatron's configs refuse, a model the
conversion cannot map, an engine that cannot load weights each raise `ConfigError`, naming the
problems (a model-wide one once), with the engine untouched. Once they pass, the `Lifecycle`
takes the engine over (releases its memory) as it always does.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from orchestrator.adapters.megatron.build import init_optimizer_state
from orchestrator.adapters.megatron.convert import (
    conversion_problems,
    hf_buckets,
    is_sync_source,
    model_spec,
)
from orchestrator.adapters.megatron.convert.served import served_problems
from orchestrator.adapters.megatron.options import Groups, Memory, Sync, grouped
from orchestrator.adapters.megatron.trainer import ALL_EXTRAS, Extra, MegatronTrainer, megatron_setup
from orchestrator.adapters.megatron.transport import Converter, MegatronTransport
from orchestrator.core.config import Checkpoint, LifecycleConfig, Verify
from orchestrator.core.lifecycle import Lifecycle, require_restore_coverage
from orchestrator.errors import ConfigError
from orchestrator.models import ModelShape, read_config
from orchestrator.protocols import MemoryRegions, Named, RolloutEngine, WeightTransport
from orchestrator.telemetry.listeners import Listener
from states import Mode

if TYPE_CHECKING:
    from orchestrator.adapters.megatron.checkpointing import MegatronCheckpointer

__all__ = ["Checkpoint", "Memory", "Sync", "Verify", "colocate_megatron", "gpt_shape", "hf_converter", "otel_listeners"]


def _chunks(model: Sequence[Any] | Any) -> list[Any]:
    return list(model) if isinstance(model, Sequence) else [model]  # Megatron's list of chunks, or one


def gpt_shape(model: Sequence[Any] | Any) -> ModelShape:
    """The shape of a Megatron GPT as an HF engine needs it (`TransformersEngine(gpt_shape(model))`):
    `shape_from_megatron` over the chunks' `TransformerConfig` and `GPTModel`, the family read
    from the config. Raises ConfigError naming every setting no HF family computes the same way."""
    try:
        return model_spec(_chunks(model))
    except ValueError as error:
        raise ConfigError([str(error)]) from None


def hf_converter(
    model: Sequence[Any], served: str | Path | Mapping[str, Any] | None = None, *, mtp: bool = False
) -> Converter:
    """The conversion `colocate_megatron` wires: `hf_buckets` over the model's live params at any
    TP, PP and EP, the family read from its config. It reads the model itself, not the sync
    tensors it is handed. `served`: the HF config the engine loaded its model from (a
    `config.json`, its folder, or its dict), read as the planner reads it. `mtp`: the MTP layers
    too, for an engine that serves them as its speculative draft (left out and logged otherwise).

    Raises ConfigError before anything is sent, naming each problem once: what the model computes
    that the family does not, every tensor of this rank's stage the family has no counterpart
    for, and everything the served config builds or computes otherwise (`served_problems`). The
    check is this rank's alone (no collective)."""
    problems = conversion_problems(model)
    if served is not None and not problems:
        problems = served_problems(model_spec(model), _read_served(served))
    if problems:
        raise ConfigError(problems)

    def converter(named: Iterable[Named], *, bucket_bytes: int) -> Iterator[Sequence[Named]]:
        return hf_buckets(model, bucket_bytes=bucket_bytes, mtp=mtp)

    return converter


def _read_served(served: str | Path | Mapping[str, Any]) -> ModelShape:
    if isinstance(served, Mapping):
        return read_config(served, source="served_config")
    path = Path(served)
    path = path / "config.json" if path.is_dir() else path
    try:
        return read_config(json.loads(path.read_text()), source=str(path))
    except (OSError, ValueError) as error:
        raise ConfigError([f"served_config {str(path)!r}: not a readable JSON config ({error})"]) from None


def otel_listeners(rank: int) -> list[Listener]:
    """A tracing listener, then a structlog listener.

    Spans go to the global tracer provider when one was set (the trainer's own). Otherwise the
    `OTEL_*` variables decide: where they ask for export, a provider of role `rank` is made and
    set as the global one, so that the adapters' own spans (`rank.cast`, `rank.bucket`, ...)
    join the lifecycle's; OpenTelemetry sets it once for the process's life, and a later call
    finds it set. Where they ask for nothing, spans go to the global no-op provider.
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from orchestrator.telemetry.logs import LoggingListener
    from orchestrator.telemetry.tracing import TracingListener, configure_tracing

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        configured = configure_tracing(rank=rank, role="rank")
        if configured is not None:
            trace.set_tracer_provider(configured)
            provider = trace.get_tracer_provider()  # another thread may have set one first
    return [TracingListener(provider), LoggingListener()]


def _regions(trainer: MegatronTrainer) -> MemoryRegions:
    """torch_memory_saver's regions where the param buffers are on a GPU, storage-freeing ones on
    the CPU: what the registry's `REGIONS` gives for that device. Not through the registry: its
    engines convert with this package, and the embedding stays below it."""
    if any(t.is_cuda for t in trainer.region_tensors()["param_buffer"]):
        from orchestrator.adapters.regions.tms import TorchMemorySaverRegions

        return TorchMemorySaverRegions(trainer.region_tensors)
    from orchestrator.adapters.regions.storage import StorageRegions

    return StorageRegions(trainer.region_tensors)


def _any_rank(flag: bool) -> bool:
    """Whether any rank passed True: an all-reduce over the default group, also its barrier."""
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    value = torch.tensor([int(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _loads_weights(engine: RolloutEngine | None, transport: WeightTransport | None) -> RolloutEngine | None:
    """The engine the default transport sends to (None where a transport is given, or no engine)."""
    if engine is None or transport is not None:
        return None
    if not engine.features.loads_weights:
        raise ConfigError([f"engine {engine.name!r} has no update_weights(named, version): pass transport="])
    return engine


def _checkpointer(model: list[Any], optimizer: Any, checkpoint: Checkpoint) -> MegatronCheckpointer | None:
    """The rank's checkpointer, if `checkpoint` saves or loads anything; with `resume`, the last
    complete checkpoint loaded into the model and optimizer (before the trainer wraps the
    optimizer: its step counter hooks it)."""
    if not checkpoint.used:
        return None
    from orchestrator.adapters.megatron.checkpointing import MegatronCheckpointer  # imports megatron.core

    checkpointer = MegatronCheckpointer(
        model, optimizer, save_dir=checkpoint.save_dir, every=checkpoint.save_every, state=checkpoint.state
    )
    if checkpoint.resume is not None:
        checkpointer.resume(checkpoint.resume)
    return checkpointer


def colocate_megatron(
    model: Sequence[Any] | Any,
    optimizer: Any,
    engine: RolloutEngine | None,
    mode: Mode | str = Mode.REMATERIALIZE,
    *,
    sync: Sync | None = None,
    memory: Memory | None = None,
    verify: Verify | None = None,
    checkpoint: Checkpoint | None = None,
    listeners: Sequence[Listener] | None = None,
    extras: Collection[Extra] = ALL_EXTRAS,
    rank: int | None = None,
    **flags: Any,
) -> Lifecycle:
    """The `Lifecycle` for one rank of a Megatron-core trainer (see the module docstring).

    `engine` must load weights (`update_weights(named, version)`, `features.loads_weights`) unless
    `sync.transport` is given; it is None in `Mode.TRAIN_ONLY`. `flags` are the `TrainingSetup`
    flags Megatron does not hold (`compute_advantages`, `lora`, `keep_old_actor`, ...); those it
    holds are read from its configs and refused as keywords. The flat keywords of the release
    before (`save_dir=`, `offload=`, `bucket_bytes=`, ...) still work, each with a
    DeprecationWarning naming its group (`orchestrator.adapters.megatron.options`).

    Raises ConfigError, naming every problem, with the engine untouched: a setup the mode refuses,
    a flag Megatron's configs hold, an engine that loads no weights, a model the HF conversion
    cannot map (when `sync.convert` and `sync.transport` are not given), a param no restore path
    covers.

    `memory=Memory(offload=, budget=, regions=)`: `offload` chooses which of `grad_buffer` and
    `default` leave the device for the rollout (`orchestrator.core.offload`); `auto` decides from
    `budget`, the memory guard's (`orchestrator.plan.MemoryProbe.for_plan(...)`), and moves both
    without one. `never` keeps both and, given a budget, raises ConfigError naming the bytes where
    the rollout does not fit beside them (checked once the engine is taken over).

    `sync=Sync(served_config=, mtp=, ...)`: `served_config` is the HF config the engine serves (a
    path or a dict): with the default converter, a model it builds or computes otherwise (another
    vocabulary, RoPE base, routed scale, tied embeddings, ...) is a ConfigError too, since an
    engine would load such weights cleanly and serve another policy. `mtp=True` syncs the MTP
    layers as well, as the checkpoint's layers after the last decoder layer, for an engine serving
    them as its NextN draft; without it they are left out, and the sync logs so once.

    `checkpoint=Checkpoint(save_dir=, save_every=, resume=, state=)`: a step `lifecycle.step(n)`
    with n a multiple of `save_every` ends with a save into `save_dir` (every rank's part; a
    directory every rank sees), with `state()`, called on rank 0, saved beside. `resume`: a
    directory whose last complete checkpoint is loaded into the model and optimizer before the
    trainer wraps them (so before the restore-coverage and conversion checks, which the engine
    still waits on); CheckpointRefused (a ConfigError) on every rank, before anything is loaded,
    where there is none or it is damaged, and naming Megatron's message where it is another
    model's. The resume point (the step to continue after, the saved state) is
    `lifecycle.checkpointer.resumed`, and the first sync pushes the saved weight version + 1.
    ConfigError names `save_every` below 0, or given without `save_dir`.
    """
    given = Groups(sync=sync or Sync(), memory=memory if isinstance(memory, Memory) else Memory(),
                   verify=verify or Verify(), checkpoint=checkpoint or Checkpoint())  # fmt: skip
    groups, flags = grouped(given, flags, memory=memory, stacklevel=2)
    sync, memory, verify, checkpoint = groups.sync, groups.memory, groups.verify, groups.checkpoint
    model = _chunks(model)
    if not torch.cuda.is_available():
        from orchestrator.adapters.megatron.cpu import enable_cpu_path

        enable_cpu_path()
    rank = _rank() if rank is None else rank
    if mode not in Mode.__members__.values():
        raise ConfigError([f"mode must be one of {', '.join(Mode)}, got {mode!r}"])
    config = LifecycleConfig(
        mode=Mode(mode),
        rank=rank,
        verify_cycles=verify.cycles,
        setup=megatron_setup(model, optimizer, **flags),
        offload=memory.offload,  # type: ignore[arg-type]  # the config takes "never" as well as Offload.NEVER
        memory=memory.budget,
    )
    sink = _loads_weights(engine, sync.transport)
    checkpointer = _checkpointer(model, optimizer, checkpoint)
    init_optimizer_state(optimizer)  # Adam's zeroed state now: the host arena is laid out once
    trainer = MegatronTrainer(model, optimizer, extras=extras, digest=verify.digest)
    if config.mode is not Mode.TRAIN_ONLY:
        require_restore_coverage(trainer.layout())  # before regions re-home anything
    transport = sync.transport
    if sink is not None:
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        transport = MegatronTransport(
            trainer,
            sink,
            convert=hf_converter(model, sync.served_config, mtp=sync.mtp) if sync.convert is None else sync.convert,
            bucket_bytes=sync.bucket_bytes,
            source=is_sync_source() if distributed else True,
            any_rank=_any_rank if distributed else None,
        )
    return Lifecycle(
        config=config,
        trainer=trainer,
        regions=_regions(trainer) if memory.regions is None else memory.regions,
        engine=engine,
        transport=transport,
        listeners=otel_listeners(rank) if listeners is None else tuple(listeners),
        checkpointer=checkpointer,
        resumed_version=checkpointer.resumed.weight_version if checkpointer and checkpointer.resumed else 0,
    )
