"""Rank processes for the Megatron-core tests: real DDP + DistributedOptimizer over gloo.

Each scenario runs in `world_size` spawned processes and writes one JSON file per rank; the
tests read those files. The restore cycle below is the order `Lifecycle` drives (pause_grads
stashes and pauses grads + optimizer state; drop_params pauses the param buffer; restore
resumes and rebuilds); here it is driven on the adapters directly to test them.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the router's torch.compile costs ~9 s cold

from guards.bitexact import restore_bit_identical
from guards.config import violations
from orchestrator.adapters.megatron.build import (
    TinyGPTConfig,
    build_gpt,
    destroy_process_group,
    init_process_group,
    train_step,
)
from orchestrator.adapters.megatron.trainer import Extra, MegatronTrainer, megatron_setup
from orchestrator.adapters.regions.storage import StorageRegions
from orchestrator.core.lifecycle import require_restore_coverage
from orchestrator.core.regions import RegionLedger
from orchestrator.errors import ConfigError, StashMismatch
from states import Mode, Region
from tests.support.spawn import spawn_ranks

CUDA = torch.cuda.is_available()
AWKWARD = TinyGPTConfig(num_experts=2, fp32_param=True, frozen_param=True)
EXPERT_BIAS = "decoder.layers.1.mlp.router.expert_bias"


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def tokens(cfg: TinyGPTConfig, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=generator)


def regions_for(trainer: MegatronTrainer) -> Any:
    """torch_memory_saver on a GPU, storage resizing on the CPU."""
    if CUDA:
        from orchestrator.adapters.regions.tms import TorchMemorySaverRegions

        return TorchMemorySaverRegions(trainer.region_tensors)
    return StorageRegions(trainer.region_tensors)


def restore_cycle(trainer: MegatronTrainer, ledger: RegionLedger, mode: Mode) -> dict[str, Any]:
    before = dict(trainer.digests())
    bias_before = trainer._extras[EXPERT_BIAS].clone() if EXPERT_BIAS in trainer._extras else None
    trainer.stash(mode)
    ledger.pause(Region.GRAD_BUFFER)
    ledger.pause(Region.DEFAULT)
    synced = dict(trainer.sync_tensors())
    address = trainer.region_tensors()[Region.PARAM_BUFFER][-1].data_ptr()
    served_from_backup = bias_before is None or torch.equal(synced[EXPERT_BIAS], bias_before.cpu())
    rss_before = rss()
    freed = ledger.pause(Region.PARAM_BUFFER)
    rss_after_drop = rss()
    for tag in (Region.DEFAULT, Region.GRAD_BUFFER, Region.PARAM_BUFFER):
        ledger.resume(tag)
    same_address = trainer.region_tensors()[Region.PARAM_BUFFER][-1].data_ptr() == address
    # Resumed pages hold whatever the allocator hands back (the heap may return the old bytes
    # of a small block). Make that garbage explicit, as torch_memory_saver's would be.
    for tensor in trainer.region_tensors()[Region.PARAM_BUFFER]:
        tensor.fill_(float("nan"))
    lost = dict(trainer.digests())
    trainer.rebuild(mode)
    after = dict(trainer.digests())
    verdict = restore_bit_identical(before, after)
    return {
        "bit_identical": verdict.ok,
        "reason": verdict.reason,
        "changed_by_drop": sorted(n for n in before if before[n] != lost[n]),
        "bytes_freed": freed,
        "param_buffer_bytes": sum(t.untyped_storage().nbytes() for t in trainer.region_tensors()[Region.PARAM_BUFFER]),
        "same_address": same_address,
        "rss_freed": rss_before - rss_after_drop,
        "served_extras_from_backup": served_from_backup,
        "pinned": trainer.host_pinned_bytes(),
        "digests": after,
    }


def cycles_scenario(rank: int, world_size: int, out: Path, cfg: TinyGPTConfig = AWKWARD) -> dict[str, Any]:
    """Both modes on one model, 3 cycles each with a real optimizer step in between."""
    chunks, optimizer = build_gpt(cfg)
    trainer = MegatronTrainer(chunks, optimizer)  # its default digest: the device's on a GPU
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
    predicted = trainer.region_bytes()  # before the Adam moments exist
    train_step(chunks, optimizer, tokens(cfg, generator))
    ledger = RegionLedger(regions_for(trainer))
    result: dict[str, Any] = {
        "region_bytes": {"before_first_step": predicted, "after_it": trainer.region_bytes()},
        "digest": trainer.digest_method.value,
        "uncovered": list(trainer.layout().uncovered),
        "setup_violations": [str(v) for v in violations(Mode.REMATERIALIZE, megatron_setup(chunks, optimizer))],
    }
    try:  # a trainer that forgets frozen params must be refused at init, naming them
        require_restore_coverage(MegatronTrainer(chunks, optimizer, extras={Extra.EXPERT_BIAS, Extra.FP32}).layout())
    except ConfigError as error:
        result["without_frozen"] = str(error)
    for mode in (Mode.REMATERIALIZE, Mode.BACKUP):
        runs = []
        for _ in range(3):
            runs.append(restore_cycle(trainer, ledger, mode))
            runs[-1]["loss"] = train_step(chunks, optimizer, tokens(cfg, generator)).loss
        result[mode.value] = runs
    # One flipped bit after a restore must be caught, naming the tensor.
    before = dict(trainer.digests())
    victim = "decoder.layers.0.mlp.linear_fc1.weight"
    trainer._params[victim].data.view(torch.int16).view(-1)[7] ^= 1 << 3
    result["flipped"] = restore_bit_identical(before, trainer.digests()).reason
    return result


def memory_scenario(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """A model large enough that freed pages show in RSS."""
    cfg = TinyGPTConfig(
        hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1536, vocab_size=4096
    )
    chunks, optimizer = build_gpt(cfg)
    trainer = MegatronTrainer(chunks, optimizer)
    regions = StorageRegions(trainer.region_tensors)
    ledger = RegionLedger(regions)
    train_step(chunks, optimizer, tokens(cfg, torch.Generator().manual_seed(0)))
    held = regions.resident_bytes()
    steps = {}
    for tag in (Region.GRAD_BUFFER, Region.PARAM_BUFFER):
        start = rss()
        steps[f"pause:{tag}"] = {"bytes": ledger.pause(tag), "rss": start - rss()}
    after_pause = regions.resident_bytes()
    for tag in (Region.GRAD_BUFFER, Region.PARAM_BUFFER):
        start = rss()
        steps[f"resume:{tag}"] = {"bytes": ledger.resume(tag), "rss_before": start}
    trainer.rebuild(Mode.REMATERIALIZE)  # touches every resumed page
    steps["rss_after_rebuild"] = rss()
    return {"held": held, "after_pause": after_pause, "steps": steps}


def _refusal(trainer: MegatronTrainer) -> str | None:
    try:
        require_restore_coverage(trainer.layout())
    except ConfigError as error:
        return str(error)
    return None


def coverage_scenario(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """Megatron's own build (router buffers left as Float16Module casts them), a cold start (the
    first stash before any forward), five cycles; coverage with each kind of extra left out;
    the names each rank hands to the sync."""
    cfg = AWKWARD
    chunks, optimizer = build_gpt(cfg, fix_router_count_dtype=False)
    result: dict[str, Any] = {
        "without_fp32": _refusal(MegatronTrainer(chunks, optimizer, extras={Extra.EXPERT_BIAS, Extra.FROZEN})),
        "without_expert_bias": _refusal(MegatronTrainer(chunks, optimizer, extras={Extra.FP32, Extra.FROZEN})),
    }
    trainer = MegatronTrainer(chunks, optimizer)
    result["sync_names"] = sorted(trainer.layout().sync_sources)
    ledger = RegionLedger(regions_for(trainer))
    generator = torch.Generator().manual_seed(100 + rank)
    cycles = []
    for _ in range(5):
        cycle = restore_cycle(trainer, ledger, Mode.REMATERIALIZE)
        cycles.append({"bit_identical": cycle["bit_identical"], "reason": cycle["reason"]})
        train_step(chunks, optimizer, tokens(cfg, generator))
    result["cycles"] = cycles
    bias = trainer._extras[EXPERT_BIAS]
    result["expert_bias"] = {"live": str(bias.dtype), "backup": str(trainer._extra_backup[EXPERT_BIAS].dtype)}
    bias.data = bias.data.to(torch.bfloat16)  # something recast it behind the trainer's back
    try:
        trainer.stash(Mode.REMATERIALIZE)
    except StashMismatch as error:
        result["recast"] = str(error)
    return result


def params_off_their_mains(trainer: MegatronTrainer, optimizer: Any) -> list[str]:
    """The bf16 params that are not cast(their fp32 main), by Megatron's own map of each main
    shard into its param (not the trainer's cast)."""
    names = {id(p): n for n, p in trainer._params.items()}
    off = []
    for opt in optimizer.chained_optimizers:
        for models, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True):
            for model, main in zip(models, mains, strict=True):
                part = opt._get_model_param_range_map(model)["param"]
                if not torch.equal(model.detach().view(-1)[part.start : part.end], main.to(model.dtype)):
                    off.append(names[id(model)])
    return off


def _a_step_that_raised(trainer: MegatronTrainer, chunks: Any, optimizer: Any, batch: torch.Tensor, mode: Mode) -> dict:
    """Stash, then a step whose inner Adam step runs and whose cast into the params raises; then
    `rebuild(mode)`. Replaced: `_copy_main_params_to_model_params` of the DistributedOptimizer
    (this instance's, once), the first call after the inner `optimizer.step()` in Megatron's
    `step_with_ready_grads`: the mains (and the fp32 param, whose main is itself) have moved, the
    bf16 params have not."""
    trainer.stash(mode)
    stashed = {n: t.detach().clone() for n, t in trainer._extras.items()}
    before = trainer.mains_generation()
    (distributed,) = optimizer.chained_optimizers

    def cast_fails() -> None:
        del distributed._copy_main_params_to_model_params
        raise RuntimeError("injected: the cast after the inner step")

    distributed._copy_main_params_to_model_params = cast_fails
    try:
        train_step(chunks, optimizer, batch)
        raised = None
    except RuntimeError as error:
        raised = str(error)
    live = {n: t.detach().clone() for n, t in trainer._extras.items()}
    off = params_off_their_mains(trainer, optimizer)
    trainer.rebuild(mode)
    return {
        "raised": raised,
        "moved": trainer.mains_generation() - before,
        "off_before_rebuild": len(off),
        "off_after_rebuild": params_off_their_mains(trainer, optimizer),
        "extras_the_step_changed": sorted(n for n in live if not torch.equal(live[n], stashed[n])),
        "extras_the_rebuild_changed": sorted(n for n in live if not torch.equal(trainer._extras[n], live[n])),
    }


def steps_scenario(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """`mains_generation` over real optimizer steps, and a rebuild after a step that raised."""
    chunks, optimizer = build_gpt(AWKWARD)
    trainer = MegatronTrainer(chunks, optimizer)
    generator = torch.Generator().manual_seed(7)
    generations = [trainer.mains_generation()]
    for _ in range(2):
        train_step(chunks, optimizer, tokens(AWKWARD, generator))
        generations.append(trainer.mains_generation())
    later = MegatronTrainer(chunks, optimizer)  # its own hooks: it counts from its construction
    result: dict[str, Any] = {"generations": generations, "later_trainer": later.mains_generation()}
    for mode in (Mode.REMATERIALIZE, Mode.BACKUP):
        result[mode.value] = _a_step_that_raised(trainer, chunks, optimizer, tokens(AWKWARD, generator), mode)
    result["later_trainer_after"] = later.mains_generation()
    return result


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "cycles": cycles_scenario,
    "memory": memory_scenario,
    "coverage": coverage_scenario,
    "steps": steps_scenario,
}


def _rank_main(rank: int, world_size: int, port: int, out: str, scenario: str, ep: int) -> None:
    path = Path(out) / f"rank{rank}.json"
    try:
        backend = "nccl" if CUDA else "gloo"
        init_process_group(rank, world_size, port, backend, expert_model_parallel_size=ep)
        result = SCENARIOS[scenario](rank, world_size, Path(out))
        destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    path.write_text(json.dumps(result))


def run_ranks(scenario: str, world_size: int, out: Path, *, ep: int = 1, timeout: float = 240) -> list[dict[str, Any]]:
    """Run `scenario` on `world_size` gloo ranks (expert parallelism `ep`); every wait is bounded."""
    return spawn_ranks(_rank_main, world_size, out, args=(scenario, ep), timeout=timeout)
