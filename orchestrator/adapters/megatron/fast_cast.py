"""The restore cast as one multi-tensor kernel, and at DP > 1 overlapped with the param exchange.

Megatron's DistributedOptimizer casts its fp32 main shards into the bf16 param buffer one param
at a time (`_copy_main_params_to_model_params`: one `copy_` per param, a few hundred launches
for a 1 B model). `MainParamCast` finds the same (main shard, param-buffer shard) pairs the
same way Megatron does and casts them all in one Triton launch. Each program of the launch casts
one block of one pair, read as 16-byte vectors where every pointer allows it. The conversion
is the one `copy_` does, round to nearest even, so the result is bit-identical (a GPU test
checks it against Megatron's own loop).

Where the kernel cannot run it calls Megatron's loop instead: on the CPU, without Triton, for
params that are not bf16, and for setups whose cast is more than a plain copy (Megatron-FSDP,
the precision-aware optimizer, fp8 or fp4 param gather). `MainParamCast.path` says which ran.

`PipelinedRestore` (DP > 1) overlaps the cast with the exchange of the param-buffer shards.
Megatron keeps one bucket per buffer unless grads are reduced overlapped, so its all-gather
(`start_param_sync`) can start only once the whole cast is done. Here each rank's shard is cut
into pieces; the cast of a piece runs on a side stream while the pieces before it are already
travelling, by NCCL send/recv pairs into the same places the all-gather would write.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MainParamCast", "PipelinedRestore", "cast_pairs", "kernel_available"]

Pair = tuple[torch.Tensor, torch.Tensor]  # (fp32 main shard, bf16 view of the param buffer)

BLOCK = 4096  # elements per program: 16 KiB read, 8 KiB written


def _supported(optimizer: Any) -> bool:
    """A DistributedOptimizer whose cast is a plain `copy_` of every main shard."""
    config, ddp = getattr(optimizer, "config", None), getattr(optimizer, "ddp_config", None)
    return (
        hasattr(optimizer, "shard_fp32_from_float16_groups")
        and not getattr(optimizer, "is_stub_optimizer", False)
        and not getattr(ddp, "use_megatron_fsdp", False)
        and not getattr(ddp, "fp8_param_gather", False)
        and not getattr(ddp, "fp4_param_gather", False)
        and not getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        and not getattr(config, "use_precision_aware_optimizer", False)
    )


def cast_pairs(optimizer: Any) -> tuple[list[Pair], list[Pair]] | None:
    """(fp32 → 16-bit pairs, fp32 → fp32 pairs) of one DistributedOptimizer, as its
    `_copy_main_params_to_model_params` computes them; None where that method does more than copy."""
    if not _supported(optimizer):
        return None
    try:
        return _pairs(optimizer)
    except (AttributeError, KeyError):  # a Megatron whose optimizer keeps its ranges otherwise
        return None


def _pairs(optimizer: Any) -> tuple[list[Pair], list[Pair]]:
    def pairs(mains: Sequence[Sequence[torch.Tensor]], models: Sequence[Sequence[torch.Tensor]]) -> list[Pair]:
        out = []
        for main_group, model_group in zip(mains, models, strict=True):
            for main, model in zip(main_group, model_group, strict=True):
                world = optimizer._get_model_param_range_map(model)["gbuf_world_in_bucket"]
                if world.size != main.nelement():
                    raise ValueError(f"main shard of {world.size} elements expected, got {main.nelement()}")
                buffer, _, bucket = optimizer.model_param_gbuf_map[model]
                param_data = optimizer.buffers[buffer].buckets[bucket].param_data
                out.append((main, param_data.view(-1)[world.start : world.end]))
        return out

    return (
        pairs(optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups),
        pairs(optimizer.shard_fp32_groups, optimizer.model_fp32_groups),
    )


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled lazily; None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def cast_fp32_to_bf16(
        src_ptrs, dst_ptrs, sizes, block_pair, block_start, BLOCK: tl.constexpr, ALIGNED: tl.constexpr
    ):
        program = tl.program_id(0)
        pair = tl.load(block_pair + program)
        start = tl.multiple_of(tl.load(block_start + program), BLOCK)
        n = tl.load(sizes + pair)
        src = tl.load(src_ptrs + pair).to(tl.pointer_type(tl.float32))
        dst = tl.load(dst_ptrs + pair).to(tl.pointer_type(tl.bfloat16))
        if ALIGNED:
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            tl.store(dst + offsets, tl.load(src + offsets).to(tl.bfloat16))
        else:
            mask = offsets < n
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask).to(tl.bfloat16), mask=mask)

    return cast_fp32_to_bf16


def kernel_available() -> bool:
    """True where the Triton cast can run: a CUDA device and an importable Triton."""
    return torch.cuda.is_available() and _kernel() is not None


class _Launch:
    """One kernel launch over `pairs`: block table built once, pointers re-read at every call
    (torch_memory_saver keeps addresses across pause and resume, but re-homing a storage moves it)."""

    def __init__(self, pairs: Sequence[Pair], block: int) -> None:
        self.pairs = list(pairs)
        self.block = block
        device = self.pairs[0][1].device
        sizes = [src.numel() for src, _ in self.pairs]
        blocks = [(i, start) for i, n in enumerate(sizes) for start in range(0, n, block)]
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.block_pair = torch.tensor([i for i, _ in blocks], dtype=torch.int32, device=device)
        self.block_start = torch.tensor([s for _, s in blocks], dtype=torch.int64, device=device)
        self._addresses: list[int] = []
        self._pointers = torch.empty(0, dtype=torch.int64, device=device)
        self._aligned = False

    def __call__(self) -> None:
        addresses = [t.data_ptr() for t, _ in self.pairs] + [t.data_ptr() for _, t in self.pairs]
        if addresses != self._addresses:
            self._addresses = addresses
            self._pointers = torch.tensor(addresses, dtype=torch.int64).to(self.sizes.device)
            self._aligned = all(a % 16 == 0 for a in addresses)
        n = len(self.pairs)
        _kernel()[(self.block_pair.numel(),)](
            self._pointers[:n],
            self._pointers[n:],
            self.sizes,
            self.block_pair,
            self.block_start,
            BLOCK=self.block,
            ALIGNED=self._aligned,
        )


class MainParamCast:
    """Casts every DistributedOptimizer's fp32 mains into its param buffer, as Megatron's
    `_copy_main_params_to_model_params` does: one Triton launch where it can, else that method.

    `use_kernel=False` forces Megatron's loop; None (the default) uses the kernel where
    `kernel_available()` and every optimizer's cast is a plain fp32 → bf16 copy.
    """

    def __init__(self, optimizers: Sequence[Any], *, use_kernel: bool | None = None, block: int = BLOCK) -> None:
        self._optimizers = [o for o in optimizers if o is not None]
        plans = [cast_pairs(o) for o in self._optimizers]
        halves: list[Pair] = [pair for plan in plans if plan is not None for pair in plan[0]]
        self._fp32: list[Pair] = [pair for plan in plans if plan is not None for pair in plan[1]]
        can = (
            kernel_available()
            and all(plan is not None for plan in plans)
            and all(src.dtype == torch.float32 and dst.dtype == torch.bfloat16 for src, dst in halves)
            and all(src.is_cuda and dst.is_cuda and src.is_contiguous() for src, dst in halves)
        )
        if use_kernel and not can:
            raise RuntimeError(
                "the Triton cast cannot run here (no CUDA, no Triton, or a cast that is not fp32 → bf16)"
            )
        self._launch = _Launch(halves, block) if can and use_kernel is not False and halves else None
        self._compiled = False
        self.pairs = halves
        self.unavailable: str | None = None  # why the kernel stopped being used, if it did

    @property
    def path(self) -> str:
        """'triton' or 'megatron': which cast `__call__` runs."""
        return "triton" if self._launch is not None else "megatron"

    @torch.no_grad()
    def __call__(self) -> None:
        if self._launch is not None and not self._compiled:
            try:  # the first launch compiles the kernel: a Triton that cannot is no Triton
                self._launch()
            except Exception as error:
                self._launch, self.unavailable = None, f"Triton cast failed to run: {error!r}"
            else:
                self._compiled = True
                self._copy_fp32()
                return
        if self._launch is None:
            for optimizer in self._optimizers:
                optimizer._copy_main_params_to_model_params()
            return
        self._launch()
        self._copy_fp32()

    def _copy_fp32(self) -> None:
        for src, dst in self._fp32:  # fp32 params: their "main" is a view of the buffer itself
            dst.copy_(src)

    def launch_for(self, pairs: Sequence[Pair]) -> _Launch:
        """A launch over a subset of `pairs` (a piece of a pipelined restore)."""
        return _Launch(pairs, self._launch.block if self._launch else BLOCK)


class PipelinedRestore:
    """Cast and exchange the param buffers piece by piece, the cast of a piece overlapping the
    exchange of the pieces before it (DP > 1 on CUDA, with the Triton cast).

    For each bucket, every rank's shard `param_data[r]` is cut into pieces of about
    `piece_bytes`; piece k of each shard travels from its owner to every other rank of the
    bucket's data-parallel group, into the place `all_gather_into_tensor` would put it. A cast
    block belongs to the piece its first element falls in, so when piece k travels every block
    that writes into it has been cast. `exchange` is how a piece travels: "p2p" (NCCL send/recv
    pairs) or "broadcast" (one NCCL broadcast per owner, coalesced into one group call; slower
    on two H200s: 7.2 ms against 4.8 ms for a 1 B model's restore).
    """

    @torch.no_grad()
    def __init__(
        self, chunks: Sequence[Any], cast: MainParamCast, *, piece_bytes: int = 128 << 20, exchange: str = "p2p"
    ) -> None:
        if cast.path != "triton":
            raise RuntimeError("PipelinedRestore needs the Triton cast")
        if exchange not in ("broadcast", "p2p"):
            raise ValueError(f"exchange must be 'broadcast' or 'p2p', got {exchange!r}")
        self._cast, self._exchange = cast, exchange
        self._stream = torch.cuda.Stream()
        by_address = sorted(cast.pairs, key=lambda pair: pair[1].data_ptr())
        self._steps: list[tuple[_Launch | None, list[torch.Tensor], Any, int]] = []
        exchanged: list[tuple[int, int]] = []  # [start, end) addresses of the buckets exchanged here
        for chunk in chunks:
            groups = getattr(chunk, "all_bucket_groups", [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups])
            for group in groups:
                if group.intra_distributed_optimizer_instance_size == 1:
                    continue
                for bucket in group.buckets:
                    self._steps += self._pieces(bucket.param_data, group, by_address, piece_bytes)
                    start = bucket.param_data.data_ptr()
                    exchanged.append((start, start + bucket.param_data.numel() * bucket.param_data.element_size()))
        # casts into buckets no other rank shares (DP = 1 for them) run first, in one launch
        rest = [(s, d) for s, d in cast.pairs if not any(lo <= d.data_ptr() < hi for lo, hi in exchanged)]
        self._rest = cast.launch_for(rest) if rest else None

    def _pieces(
        self, data: torch.Tensor, group: Any, pairs: list[Pair], piece_bytes: int
    ) -> list[tuple[_Launch | None, list[torch.Tensor], Any, int]]:
        size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
        pg = group.intra_distributed_optimizer_instance_group
        flat = data.view(-1)
        width = flat.element_size()
        shard = flat.numel() // size
        step = max(1, piece_bytes // width)
        base, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * width
        mine = [(s, d) for s, d in pairs if base <= d.data_ptr() < end]
        out = []
        for lo in range(0, shard, step):
            hi = min(shard, lo + step)
            first, last = base + (rank * shard + lo) * width, base + (rank * shard + hi) * width
            cast: list[Pair] = []
            for src, dst in mine:
                whole = dst.data_ptr()
                if whole + dst.numel() * width <= first or whole >= last:
                    continue
                # the blocks of this pair whose first element lies in [first, last)
                skip = max(0, -(-(first - whole) // width // BLOCK)) * BLOCK
                stop = min(dst.numel(), -(-(last - whole) // width // BLOCK) * BLOCK)
                if skip < stop:
                    cast.append((src[skip:stop], dst[skip:stop]))
            views = [flat[r * shard + lo : r * shard + hi] for r in range(size)]
            out.append((self._cast.launch_for(cast) if cast else None, views, pg, rank))
        return out

    def _send(self, views: list[torch.Tensor], group: Any, rank: int) -> list[Any]:
        dist = torch.distributed
        owners = [dist.get_global_rank(group, r) for r in range(len(views))]
        if self._exchange == "broadcast":
            with dist._coalescing_manager(group, async_ops=True) as manager:
                for view, owner in zip(views, owners, strict=True):
                    dist.broadcast(view, src=owner, group=group)
            return [manager]
        ops = []
        for peer, owner in enumerate(owners):
            if peer != rank:
                ops.append(dist.P2POp(dist.isend, views[rank], owner, group))
                ops.append(dist.P2POp(dist.irecv, views[peer], owner, group))
        return list(dist.batch_isend_irecv(ops))

    @torch.no_grad()
    def __call__(self) -> None:
        main = torch.cuda.current_stream()
        self._stream.wait_stream(main)
        if self._rest is not None:
            with torch.cuda.stream(self._stream):
                self._rest()
        works = []
        for launch, views, group, rank in self._steps:
            if launch is not None:
                with torch.cuda.stream(self._stream):
                    launch()
                main.wait_stream(self._stream)
            works += self._send(views, group, rank)
        for work in works:
            work.wait()
        main.wait_stream(self._stream)
        for src, dst in self._cast._fp32:
            dst.copy_(src)
