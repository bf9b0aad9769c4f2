"""A trainer's live Megatron params → HF tensors in buckets, at any TP, PP and EP.

    for bucket in hf_buckets(model_chunks, bucket_bytes=256 << 20):  # the family: from the config
        if is_sync_source():
            transport.send(bucket)   # [(hf_name, tensor)]; the bucket is emptied when the next is asked for

Every rank of the model calls `hf_buckets` (the gathers are collectives) and walks the same
tensors in the same order. Each rank yields the HF tensors of its own pipeline stage, so the
source ranks (tensor-, data- and context-parallel rank 0, one per stage, see `is_sync_source`)
together send the whole model once.

- **TP.** A sharded param (Megatron marks it `tensor_model_parallel`, with its `partition_dim`)
  is all-gathered once over its tensor-parallel group and concatenated along that dim. The gated
  MLP's `linear_fc1` is the exception: each shard is its own `[gate; up]`, so the halves of every
  shard are concatenated apart. `linear_qkv` shards hold whole query groups, so their
  concatenation is the unsharded group interleave that `to_hf` splits.
- **PP.** A stage numbers its layers from 0; the global index is the layer's own
  `layer_number - 1` (Megatron adds `get_transformer_layer_offset` when it builds the layer).
- **EP.** A rank numbers its experts from 0. Expert params are gathered once over the expert
  tensor-and-model-parallel group, and each part takes the global index of the rank it came from.
  A GroupedMLP's `weight1`/`weight2` hold all of a rank's experts: each expert's block is taken
  apart as the SequentialMLP tensor it equals (`grouped`) and gathered on its own, as those are.
- **Tied embeddings.** A PP > 1 last stage's `output_layer.weight` is a copy of the first stage's
  embedding (Megatron keeps the two equal); HF holds it once, as `embed_tokens`, so the copy is
  neither gathered nor sent.

Memory: a bucket is at most `bucket_bytes` (a single tensor larger than that is a bucket alone).
Before a tensor is gathered, the bucket it would overflow is handed out; when the consumer asks
for the next bucket, the last one is emptied. So beyond its params a rank holds one bucket, plus
the tensor in flight while it is split. Every yielded tensor is fresh memory, never the live
param or the trainer's extras backup: a consumer may keep, move or write it freely.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator.adapters.megatron.convert import mtp as mtp_layers
from orchestrator.adapters.megatron.convert.grouped import GROUPED, per_expert
from orchestrator.adapters.megatron.convert.hf import hf_targets, to_hf
from orchestrator.adapters.megatron.convert.spec import Family, shape_from_megatron
from orchestrator.models import ModelShape, support_table

__all__ = ["conversion_problems", "hf_buckets", "is_sync_source", "left_out", "model_spec", "say_once", "unwrap_gpt"]

Bucket = list[tuple[str, torch.Tensor]]
_log = logging.getLogger(__name__)
# What `hf_buckets` has logged as left out, held for the process's life (one rank holds every
# sync of its model): a note is logged once, whichever thread syncs first.
_said: set[str] = set()
_said_lock = threading.Lock()


def say_once(notes: list[str]) -> None:
    """Log each of `notes` as a warning, unless this process already has."""
    with _said_lock:
        new = [note for note in dict.fromkeys(notes) if note not in _said]
        _said.update(new)
    for note in new:
        _log.warning(note)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def unwrap_gpt(chunk: Any) -> Any:
    """The `GPTModel` inside DDP and `Float16Module` wrappers."""
    from megatron.core.models.gpt import GPTModel

    model = chunk
    while not isinstance(model, GPTModel):
        inner = getattr(model, "module", None)
        if inner is None:
            raise TypeError(f"no GPTModel inside {type(chunk).__name__}")
        model = inner
    return model


def model_spec(model_chunks: Sequence[Any], family: Family | str | None = None, config: Any = None) -> ModelShape:
    """The conversion's `ModelShape`, from the `TransformerConfig` (the chunks' own by default); the
    family is the one the config reads as (`family_of`) unless given. Raises ValueError as
    `shape_from_megatron` does."""
    gpt = unwrap_gpt(model_chunks[0])
    return shape_from_megatron(config if config is not None else gpt.config, gpt, family)


def conversion_problems(
    model_chunks: Sequence[Any], family: Family | str | None = None, config: Any = None, *, mtp: bool = False
) -> list[str]:
    """Why `hf_buckets` would refuse these chunks, each problem once; empty when it would not.
    Local to this rank (no collective): what the model computes that `family` does not, else
    every tensor of this rank's stage the family has no counterpart for; then, once, the
    families and layouts colocate converts (`orchestrator.models.SUPPORT`)."""
    try:
        spec = model_spec(model_chunks, family, config)
    except ValueError as error:
        problems = [str(error)]
    else:
        problems = []
        for unit in _units(model_chunks, mtp=mtp):
            try:
                hf_targets(unit.name, spec)
            except ValueError as error:
                problems.append(str(error))
    problems = list(dict.fromkeys(problems))
    if problems and support_table() not in problems[-1]:
        problems[-1] += f"\ncolocate converts to\n{support_table()}"
    return problems


def left_out(model_chunks: Sequence[Any], *, mtp: bool = False) -> list[str]:
    """What `hf_buckets` leaves out of this rank's stage on purpose, one sentence each (no
    collective): the MTP layers unless `mtp`. `hf_buckets` logs it (once a process)."""
    return mtp_layers.left_out(
        [name for chunk in model_chunks for name, _ in unwrap_gpt(chunk).named_parameters()], mtp
    )


def is_sync_source() -> bool:
    """Whether this rank sends what `hf_buckets` yields: tensor-, data- and context-parallel rank 0,
    one rank per pipeline stage."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


@dataclass(frozen=True)
class _Groups:
    """This rank's process groups and where it sits in them."""

    tp: Any
    tp_size: int
    experts: Any  # expert tensor-and-model-parallel group
    experts_size: int
    # For each rank of `experts`: (its expert-parallel rank, its expert-tensor-parallel rank).
    expert_ranks: tuple[tuple[int, int], ...]
    local_experts: int

    @classmethod
    def current(cls, spec: ModelShape, device: torch.device) -> _Groups:
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_group()
        tp_size = torch.distributed.get_world_size(tp)
        if not spec.num_experts:
            return cls(tp, tp_size, None, 1, ((0, 0),), 0)
        experts = ps.get_expert_tensor_and_model_parallel_group()
        size = torch.distributed.get_world_size(experts)
        # On the params' device: NCCL gathers only CUDA tensors.
        mine = torch.tensor([ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()], device=device)
        everyone = [torch.empty_like(mine) for _ in range(size)]
        torch.distributed.all_gather(everyone, mine, group=experts)
        ranks = tuple((int(r[0]), int(r[1])) for r in everyone)
        local = spec.num_experts // ps.get_expert_model_parallel_world_size()
        return cls(tp, tp_size, experts, size, ranks, local)


@dataclass(frozen=True)
class _Unit:
    """One local tensor and how it becomes whole."""

    name: str  # global layer index, local expert index
    tensor: torch.Tensor
    expert: bool
    partition_dim: int | None  # None: not sharded over tensor parallelism

    def whole_bytes(self, groups: _Groups) -> int:
        size = self.tensor.numel() * self.tensor.element_size()
        if self.expert:
            return size * groups.experts_size
        return size * (groups.tp_size if self.partition_dim is not None else 1)


def _units(model_chunks: Sequence[Any], *, mtp: bool = True) -> Iterator[_Unit]:
    """The tensors a sync converts, in order; `mtp` False leaves the MTP layers out."""
    for chunk in model_chunks:
        gpt = unwrap_gpt(chunk)
        named = [*gpt.named_parameters(), *((n, b) for n, b in gpt.named_buffers() if n.endswith("expert_bias"))]
        for local, tensor in named:
            if local.startswith("embedding.") and not gpt.pre_process:
                continue  # the MTP stage's copy of the first stage's embedding (see `mtp_layers`)
            if mtp_layers.is_mtp(local) and not mtp:
                continue
            name = _global_layer(local, gpt)
            if GROUPED.match(name):  # all local experts in one param: one unit per expert
                experts = gpt.get_submodule(local.rsplit(".", 1)[0]).num_local_experts
                for expert, view, dim in per_expert(name, tensor.detach(), experts, gpt.config.hidden_size):
                    yield _Unit(name=expert, tensor=view, expert=True, partition_dim=dim)
                continue
            sharded = bool(getattr(tensor, "tensor_model_parallel", False))
            yield _Unit(
                name=name,
                tensor=tensor.detach(),
                expert=".local_experts." in local,
                partition_dim=int(tensor.partition_dim) if sharded else None,
            )


def _global_layer(name: str, gpt: Any) -> str:
    if mtp_layers.is_mtp(name):
        return mtp_layers.global_name(name, gpt)
    match = _LAYER.match(name)
    if match is None:
        return name
    layer = gpt.decoder.layers[int(match[1])].layer_number - 1  # the stage's offset included
    return f"decoder.layers.{layer}.{name[match.end() :]}"


def _concat(shards: list[torch.Tensor], name: str, dim: int) -> torch.Tensor:
    if name.endswith("linear_fc1.weight") and dim == 0:
        halves = [shard.chunk(2, dim=0) for shard in shards]  # each shard is its own [gate; up]
        return torch.cat([*(gate for gate, _ in halves), *(up for _, up in halves)], dim=0)
    return torch.cat(shards, dim=dim)


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    tensor = tensor.contiguous()  # a GroupedMLP expert's block is a transposed view
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(parts, tensor, group=group)
    return parts


def _whole(unit: _Unit, groups: _Groups) -> list[tuple[str, torch.Tensor]]:
    """The whole Megatron tensor(s) `unit` is a part of, each under its global name: fresh memory."""
    if unit.expert:
        if groups.experts_size == 1:
            parts = [unit.tensor.clone(memory_format=torch.contiguous_format)]
        else:
            parts = _all_gather(unit.tensor, groups.experts, groups.experts_size)
        by_expert: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (ep, etp), part in zip(groups.expert_ranks, parts, strict=True):
            by_expert.setdefault(ep, []).append((etp, part))
        local = int(_LOCAL_EXPERT.search(unit.name)[1])  # type: ignore[index]
        out = []
        for ep, pieces in sorted(by_expert.items()):
            shards = [part for _, part in sorted(pieces, key=lambda p: p[0])]
            sharded = len(shards) > 1 and unit.partition_dim is not None
            whole = _concat(shards, unit.name, unit.partition_dim or 0) if sharded else shards[0]
            name = _LOCAL_EXPERT.sub(f".local_experts.{ep * groups.local_experts + local}.", unit.name)
            out.append((name, whole))
        return out
    if unit.partition_dim is None or groups.tp_size == 1:
        return [(unit.name, unit.tensor.clone())]
    # The vocab-parallel embedding and output layer split `GPTModel.vocab_size` rows evenly, so
    # their shards concatenate to exactly the vocab the HF config gets.
    return [(unit.name, _concat(_all_gather(unit.tensor, groups.tp, groups.tp_size), unit.name, unit.partition_dim))]


def hf_buckets(
    model_chunks: Sequence[Any],
    config: Any = None,
    *,
    family: Family | str | None = None,
    bucket_bytes: int,
    mtp: bool = False,
) -> Iterator[Bucket]:
    """This rank's pipeline stage as HF `(name, tensor)` buckets of at most `bucket_bytes`.

    `model_chunks` are the DDP chunks (or bare GPTModels) of this rank; `config` is the
    `TransformerConfig` (the chunks' own by default); `family` is the one the config reads as
    (`family_of`: DSA → glm_moe_dsa, MLA → deepseek_v3, sigmoid-routed experts → glm4_moe, other
    experts → qwen3_moe with a q/k norm, else mixtral; dense: qwen3 with a q/k norm, else llama)
    unless given. Call it on every rank of the model, in the same order as its other collectives;
    only `is_sync_source()` ranks need send the buckets. `mtp`: also the MTP layers, as the
    checkpoint's layers after the last decoder layer (for an engine's NextN draft); without it
    they are left out and logged.
    A bucket is emptied when the next is asked for: keep what it holds, not the list.

    Raises ValueError before any collective when `family` cannot compute what the model computes
    (every problem named) or has no counterpart for one of its tensors (named).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    spec = model_spec(model_chunks, family, config)
    units = list(_units(model_chunks, mtp=mtp))
    say_once(left_out(model_chunks, mtp=mtp))
    # Every name is checked before the first collective, so no rank waits alone; a tensor with
    # no HF counterpart to send (tied embeddings' output layer) is not gathered.
    units = [unit for unit in units if hf_targets(unit.name, spec)]
    groups = _Groups.current(spec, units[0].tensor.device)
    bucket: Bucket = []
    held = 0
    for unit in units:
        size = unit.whole_bytes(groups)
        if bucket and held + size > bucket_bytes:
            yield bucket
            bucket.clear()  # the consumer has had it: drop the references before gathering more
            bucket, held = [], 0
        for name, whole in _whole(unit, groups):
            bucket.extend(to_hf(name, whole, spec))
        held += size
    if bucket:
        yield bucket
        bucket.clear()
