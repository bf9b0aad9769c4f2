"""Bytes per rank and per lifecycle phase, from a model's tensors and how they are sharded.

Megatron-core's DDP puts each rank's trainable params in flat buffers, one per (dense or
expert, dtype): each param starts on a multiple of 64 elements and the buffer ends on a
multiple of lcm(DP, 128) under the distributed optimizer. The grad buffer mirrors it (fp32
with `grad_reduce_in_fp32`). The DistributedOptimizer gives each rank 1/DP of the fp32 mains
and Adam moments (1/expert-DP for experts). The planner counts those the same way, and what
a `dist_checkpointing` save of the model and that optimizer state writes (`Plan.checkpoint_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from orchestrator.core.offload import Residency, choose
from orchestrator.errors import ConfigError
from orchestrator.models import ModelShape
from orchestrator.plan.model import (
    Kind,
    LayerSpec,
    Tensor,
    kv_bytes_per_token,
    stage_tensors,
    total_bytes,
    total_params,
)
from states import EngineMemory, MemoryBudget, Mode, Offload, Region

GB = 1e9


class GradDtype(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """TP x PP x DP ranks; experts split EP x expert-TP within each stage's TP x DP ranks;
    `spec`: the Megatron layer spec, which decides how MLA's down projections shard.

    `etp` left out (None) is `tp`, as megatron-core's `initialize_model_parallel` makes it when
    `expert_tensor_parallel_size` is not given; `etp_is_tp` says the plan took that default."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = None  # type: ignore[assignment]  # None: `tp` (resolved in __post_init__)
    etp_is_tp: bool = field(default=False, init=False)
    pp_layers: tuple[int, ...] = ()  # decoder layers per stage; () splits evenly
    spec: LayerSpec = LayerSpec.TE

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
            object.__setattr__(self, "etp_is_tp", True)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.dp // (self.ep * self.etp)

    def problems(self, m: ModelShape) -> list[str]:
        sizes = {k: v for k, v in vars(self).items() if isinstance(v, int) and not isinstance(v, bool)}
        out = [f"{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
        empty = [n for n in self.pp_layers if n < 1]
        if empty:
            out.append(f"--pp-layers {','.join(map(str, self.pp_layers))}: every stage needs >= 1 layer")
        if out:
            return out
        checks = [
            (m.num_attention_heads, self.tp, "attention heads", "TP"),
            (m.num_query_groups if not m.mla else self.tp, self.tp, "query groups (KV heads)", "TP"),
            (m.ffn_hidden_size, self.tp, "the dense FFN size", "TP"),
            (m.moe_shared_ffn_hidden_size or self.tp, self.tp, "the shared-expert FFN size", "TP"),
        ]
        if m.moe_layers:
            checks += [
                (m.num_experts, self.ep, "routed experts", "EP"),
                (m.moe_ffn_hidden_size, self.etp, "the expert FFN size", "expert TP"),
                (self.tp * self.dp, self.ep * self.etp, "TP x DP ranks of a stage", "EP x expert TP"),
            ]
        if m.mla and self.spec is LayerSpec.LOCAL:
            checks += [
                (m.q_lora_rank, self.tp, "the q LoRA rank", "TP (the local spec splits the down projections)"),
                (m.kv_lora_rank + m.qk_rope_head_dim, self.tp, "the kv LoRA rank + RoPE dim", "TP"),
            ]
        out = [f"{what} ({n}) do not divide by {by} ({d})" for n, d, what, by in checks if n % d]
        if m.dsa_index_n_heads and self.spec is LayerSpec.LOCAL:
            out.append(
                "the DSA indexer: megatron-core builds it only with the TE spec (its indexer linears are "
                "TE's replicated Linear; the local backend has none): use --spec te"
            )
        if self.pp_layers:
            if len(self.pp_layers) != self.pp or sum(self.pp_layers) != m.num_layers:
                out.append(
                    f"--pp-layers {','.join(map(str, self.pp_layers))} must give {self.pp} stages "
                    f"summing to the model's {m.num_layers} layers"
                )
        elif m.num_layers % self.pp:
            even = m.num_layers // self.pp
            split = [even + (i < m.num_layers % self.pp) for i in range(self.pp)]
            out.append(
                f"{m.num_layers} layers do not divide by PP ({self.pp}): give a split, "
                f"e.g. --pp-layers {','.join(map(str, split))}"
            )
        return out

    def stages(self, m: ModelShape) -> list[range]:
        sizes = self.pp_layers or (m.num_layers // self.pp,) * self.pp
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    distributed: bool = True  # Megatron's DistributedOptimizer: mains and moments sharded over DP
    grad_dtype: GradDtype = GradDtype.FP32  # grad_reduce_in_fp32
    adam: bool = True  # Adam's two fp32 moments; False: plain SGD, no state


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """The rollout engine on the same GPUs: one replica spans `gpus` GPUs (0: one trainer replica's)."""

    gpus: int = 0
    device_bytes: int = 143_771 * 2**20  # an H200
    mem_fraction_static: float = 0.8  # SGLang's: weights + KV pool, sized on an empty GPU
    cuda_graph_bytes: int = 0  # what this engine's CUDA graphs take; measure it, 0 leaves it out
    # Tokens the KV cache holds (the transformers engine: max_batch x max_len); 0: the KV pool is
    # what mem_fraction_static leaves beside the weights, as SGLang sizes it.
    kv_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class RankBytes:
    """One rank's trainer memory (any rank of its stage: TP and EP shards are equal)."""

    stage: int
    layers: int
    params: int  # numel this rank holds, extras included
    param_buffer: int  # bytes of the DDP param buffers (bf16, and fp32 params' own buffer)
    grad_buffer: int
    mains: int  # fp32 main params of this rank's optimizer shard
    adam: int  # Adam moments of this rank's shard
    extras: int  # expert_bias buffers, fp32 params, frozen params: what rematerialize pins
    frozen: int  # bytes of frozen params (resident, in no buffer)
    backup: int  # what backup mode pins: the param buffers and the extras
    # What a checkpoint writes (`Plan.checkpoint_written`): its params and persistent buffers in
    # their dtypes, the last stage's embedding copy left out (the first stage saves it) ...
    model_shard: int
    # ... and its optimizer shard as the distributed optimizer's `dp_reshardable` state holds it:
    # the fp32 main (an fp32 param's own value) and the moments, over this rank's part of each
    # buffer up to its last param (the 64-element alignment in, the end padding out).
    optimizer_shard: int
    stage_optimizer: int  # the same over every rank of the stage: each buffer once per DP group

    @property
    def optimizer_state(self) -> int:
        return self.mains + self.adam

    @property
    def trainer_state(self) -> int:
        return self.param_buffer + self.grad_buffer + self.mains + self.adam + self.frozen


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelShape
    parallel: Parallelism
    optimizer: OptimizerSpec
    engine: EngineSpec
    mode: Mode
    gpus_per_node: int
    ranks: list[RankBytes] = field(default_factory=list)  # one per stage
    engine_weights: int = 0  # bytes per GPU
    kv_cache: int = 0  # bytes per GPU
    kv_token_bytes: int = 0  # KV cache bytes of one token on one engine GPU
    offload: Offload = Offload.ALWAYS
    residency: tuple[Residency, ...] = ()  # the offload choice of each stage's ranks

    def host_pinned(self, r: RankBytes) -> int:
        return r.backup if self.mode is Mode.BACKUP else r.extras

    def region_bytes(self, r: RankBytes) -> dict[Region, int]:
        return {
            Region.PARAM_BUFFER: r.param_buffer,
            Region.GRAD_BUFFER: r.grad_buffer,
            Region.DEFAULT: r.optimizer_state,
        }

    def engine_bytes(self) -> dict[EngineMemory, int]:
        return {
            EngineMemory.WEIGHTS: self.engine_weights,
            EngineMemory.KV_CACHE: self.kv_cache,
            EngineMemory.CUDA_GRAPH: self.engine.cuda_graph_bytes,
        }

    def checkpoint_written(self, r: RankBytes) -> int:
        """Bytes one `dist_checkpointing.save` (torch_dist) writes from the stage's busiest rank: the
        data-parallel replica that saves its model shard, and its optimizer shard. The writer copies
        each tensor to host memory first, so this is also the host memory a save needs, at most."""
        return r.model_shard + r.optimizer_shard

    def checkpoint_bytes(self) -> tuple[int, int]:
        """(model, optimizer) bytes of the whole checkpoint: every model tensor once (replicas over
        TP, DP and stages are saved by one of them), and every rank's optimizer shard."""
        return total_bytes(self.model, self.parallel.tp), sum(r.stage_optimizer for r in self.ranks)

    def kept(self, r: RankBytes) -> frozenset[Region]:
        """The regions the offload choice keeps resident on this stage's ranks."""
        return self.residency[r.stage].keep if self.residency else frozenset()

    def phases(
        self, r: RankBytes, *, engine: bool = True, keep: frozenset[Region] | None = None
    ) -> dict[str, tuple[int, int]]:
        """(device, host) bytes of one rank in each phase, at its peak (activations excluded).

        Host counts the pinned backup of the mode and, where `default` moves, the host arena its
        fp32 mains and Adam moments go to: pinned once and kept, so every phase holds it, TRAIN too.
        `engine=False` leaves the engine's memory out: the trainer's alone. `keep`: the regions
        that stay resident through the sleep (default: the plan's offload choice).
        """
        keep = self.kept(r) if keep is None else keep
        pinned, regions = self.host_pinned(r), self.region_bytes(r)
        opt = 0 if Region.DEFAULT in keep else r.optimizer_state
        stays = r.frozen + sum(regions[tag] for tag in keep)
        weights, kv = (self.engine_weights, self.kv_cache + self.engine.cuda_graph_bytes) if engine else (0, 0)
        return {
            "train": (r.trainer_state, pinned + opt),
            "grads_paused": (r.param_buffer + stays, pinned + opt),
            "update_weights": (r.param_buffer + stays + weights, pinned + opt),
            "params_dropped": (stays + weights, pinned + opt),
            "rollout": (stays + weights + kv, pinned + opt),
            # The engine releases first, then the regions come back and the rebuild writes them.
            "restore": (r.trainer_state, pinned + opt),
        }

    def node_totals(self) -> list[tuple[int, int, int]]:
        """(node, device peak, host peak) per node; ranks in Megatron's order, PP outermost."""
        per_stage = self.parallel.world // self.parallel.pp
        nodes = math.ceil(self.parallel.world / self.gpus_per_node)
        out = []
        for node in range(nodes):
            ranks = range(node * self.gpus_per_node, min((node + 1) * self.gpus_per_node, self.parallel.world))
            phases = [self.phases(self.ranks[r // per_stage]) for r in ranks]
            device = max(sum(p[name][0] for p in phases) for name in phases[0])
            host = max(sum(p[name][1] for p in phases) for name in phases[0])
            out.append((node, device, host))
        return out


def _pad(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def laid_out_numel(tensors: list[Tensor], distributed: bool) -> int:
    """Elements of one Megatron DDP buffer holding `tensors` up to its last param's end: under the
    distributed optimizer each param starts on a multiple of 64, and the params are laid out last
    first (Megatron's reverse order), so the first of `tensors` ends the buffer unpadded."""
    if not tensors or not distributed:
        return sum(t.numel for t in tensors)
    return sum(_pad(t.numel, 64) for t in tensors[1:]) + tensors[0].numel


def buffer_numel(tensors: list[Tensor], dp: int, distributed: bool) -> int:
    """Elements of one Megatron DDP buffer holding `tensors` (one bucket: no overlapped reduce)."""
    laid_out = laid_out_numel(tensors, distributed)
    return _pad(laid_out, math.lcm(dp, 128)) if tensors and distributed else laid_out


def rank_bytes(m: ModelShape, par: Parallelism, opt: OptimizerSpec, stage: int) -> RankBytes:
    layers = par.stages(m)[stage]
    tensors = stage_tensors(
        m, layers, first=stage == 0, last=stage == par.pp - 1, tp=par.tp, ep=par.ep, etp=par.etp, spec=par.spec
    )
    param_buffer = grad_buffer = mains = adam = optimizer_shard = stage_optimizer = 0
    grad_width = 4 if opt.grad_dtype is GradDtype.FP32 else 2
    state_width = 12 if opt.adam else 4  # per element saved: the fp32 main, and Adam's two moments
    for expert, dp in ((False, par.dp), (True, par.expert_dp)):
        shard = dp if opt.distributed else 1
        for kind, width in ((Kind.PARAM, 2), (Kind.FP32, 4)):
            group = [t for t in tensors if t.expert is expert and t.kind is kind]
            numel = buffer_numel(group, dp, opt.distributed)
            laid_out = laid_out_numel(group, opt.distributed)
            optimizer_shard += state_width * min(numel // shard, laid_out)  # DP rank 0's part is whole
            # One buffer per DP group: TP x DP // DP dense ones, EP x expert TP expert ones. (Without
            # the distributed optimizer, state replicated over TP is counted once per TP rank.)
            stage_optimizer += state_width * laid_out * (par.tp * par.dp // dp)
            param_buffer += width * numel
            grad_buffer += (4 if kind is Kind.FP32 else grad_width) * numel
            trainable = sum(t.numel for t in group)
            if kind is Kind.PARAM:
                mains += 4 * trainable // shard
            if opt.adam:
                adam += 8 * trainable // shard
    extras = sum(t.nbytes for t in tensors if t.kind is not Kind.PARAM)
    frozen = sum(t.nbytes for t in tensors if t.kind is Kind.FROZEN)
    return RankBytes(
        stage=stage,
        layers=len(layers),
        params=sum(t.numel for t in tensors if t.kind is not Kind.EXPERT_BIAS),
        param_buffer=param_buffer,
        grad_buffer=grad_buffer,
        mains=mains,
        adam=adam,
        extras=extras,
        frozen=frozen,
        backup=param_buffer + extras,
        model_shard=sum(t.nbytes for t in tensors if not t.copy),
        optimizer_shard=optimizer_shard,
        stage_optimizer=stage_optimizer,
    )


def plan(
    model: ModelShape,
    parallel: Parallelism,
    *,
    optimizer: OptimizerSpec | None = None,
    engine: EngineSpec | None = None,
    mode: Mode = Mode.REMATERIALIZE,
    gpus_per_node: int = 8,
    offload: Offload = Offload.AUTO,
) -> Plan:
    """Plan every stage's memory and the offload choice of its ranks (core/offload.py): the
    engine's weights, KV cache and graphs against one GPU, beside the regions kept resident.
    Raises ConfigError naming each problem with the input, or what `never` cannot keep."""
    optimizer, engine = optimizer or OptimizerSpec(), engine or EngineSpec()
    problems = parallel.problems(model)
    if gpus_per_node < 1:
        problems.append(f"gpus per node must be >= 1, got {gpus_per_node}")
    if not 0 < engine.mem_fraction_static <= 1:
        problems.append(f"mem_fraction_static must be in (0, 1], got {engine.mem_fraction_static}")
    if engine.kv_tokens < 0:
        problems.append(f"kv_tokens must be >= 0, got {engine.kv_tokens}")
    if engine.gpus < 0 or engine.device_bytes <= 0 or engine.cuda_graph_bytes < 0:
        problems.append(
            f"engine gpus must be >= 0, device bytes > 0 and CUDA graph bytes >= 0, got {engine.gpus}, "
            f"{engine.device_bytes}, {engine.cuda_graph_bytes}"
        )
    if mode is Mode.REMATERIALIZE and not optimizer.distributed:
        problems.append("rematerialize needs the distributed optimizer (its fp32 mains rebuild the params)")
    if problems:
        raise ConfigError(problems)
    ranks = [rank_bytes(model, parallel, optimizer, s) for s in range(parallel.pp)]
    gpus = engine.gpus or parallel.world // parallel.dp
    weights = 2 * total_params(model) // gpus
    token = kv_bytes_per_token(model, gpus)
    kv = (
        engine.kv_tokens * token
        if engine.kv_tokens
        else max(0, int(engine.mem_fraction_static * engine.device_bytes) - weights)
    )
    the_plan = Plan(
        model=model,
        parallel=parallel,
        optimizer=optimizer,
        engine=engine,
        mode=mode,
        gpus_per_node=gpus_per_node,
        ranks=ranks,
        engine_weights=weights,
        kv_cache=kv,
        kv_token_bytes=token,
        offload=Offload(offload),
    )
    return replace(the_plan, residency=tuple(_choose(the_plan, r) for r in ranks))


def _choose(p: Plan, r: RankBytes) -> Residency:
    """One stage's choice, on a GPU of the engine's size; what no region holds (frozen params)
    stays resident throughout, so it comes off the limit."""
    budget = MemoryBudget(
        device_limit=p.engine.device_bytes - r.frozen,
        regions=p.region_bytes(r),
        engine=p.engine_bytes(),
        source=f"a {p.engine.device_bytes / GB:.2f} GB GPU (stage {r.stage})",
    )
    return choose(p.offload, budget)
