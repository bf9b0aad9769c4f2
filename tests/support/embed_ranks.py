"""One gloo rank for the embedding's tests: real megatron-core on the CPU, a real transformers engine.

Each scenario builds what it needs, runs, and returns a JSON-able dict; `spawn_ranks` runs them in
a fresh process (megatron's parallel state and the CPU path are process-wide).
"""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the router's torch.compile costs ~9 s cold

from guards.bitexact import restore_bit_identical
from orchestrator import ActionFailed, ConfigError, Sync, Trainer, colocate_megatron
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.build import TinyGPTConfig, build_gpt, destroy_process_group, init_process_group
from orchestrator.adapters.megatron.build import train_step as lm_step
from orchestrator.adapters.megatron.convert import hf_config, to_hf
from orchestrator.adapters.megatron.embed import gpt_shape
from orchestrator.adapters.megatron.trainer import MegatronTrainer
from orchestrator.adapters.megatron.transport import SyncTensorWritten, per_tensor
from orchestrator.adapters.regions.storage import StorageRegions
from orchestrator.core.regions import RegionLedger
from orchestrator.protocols import EngineDefaults, EngineFeatures, Named
from orchestrator.telemetry.tracing import TracingListener
from states import EngineMemory, Mode, Phase, Region, Source

DENSE = TinyGPTConfig()
AWKWARD = TinyGPTConfig(num_experts=2, fp32_param=True, frozen_param=True)  # all three kinds of extra


def tokens(cfg: TinyGPTConfig, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def _refusal(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except ConfigError as error:
        return str(error)
    return None


def extras_written_scenario() -> dict[str, Any]:
    """A transport that writes into every extra it is handed (as a careless in-place convert
    would), then the drop and the restore: the restore must still be bit-identical."""
    chunks, optimizer = build_gpt(AWKWARD)
    lm_step(chunks, optimizer, tokens(AWKWARD, 0))  # expert_bias moves off 0, Adam state exists
    trainer = MegatronTrainer(chunks, optimizer)
    result: dict[str, Any] = {"is_trainer": isinstance(trainer, Trainer)}
    ledger = RegionLedger(StorageRegions(trainer.region_tensors))
    sources = trainer.layout().sync_sources
    cycles = []
    for cycle in range(2):
        before = dict(trainer.digests())
        trainer.stash(Mode.REMATERIALIZE)
        ledger.pause(Region.GRAD_BUFFER)
        ledger.pause(Region.DEFAULT)
        written = []
        for name, tensor in trainer.sync_tensors():  # the transport's read, with the injected write
            if sources[name] is Source.EXTRAS:
                tensor.fill_(float("nan"))
                written.append(name)
        ledger.pause(Region.PARAM_BUFFER)
        for tag in (Region.DEFAULT, Region.GRAD_BUFFER, Region.PARAM_BUFFER):
            ledger.resume(tag)
        trainer.rebuild(Mode.REMATERIALIZE)
        verdict = restore_bit_identical(before, trainer.digests())
        cycles.append({"written": sorted(written), "bit_identical": verdict.ok, "reason": verdict.reason})
        lm_step(chunks, optimizer, tokens(AWKWARD, 1 + cycle))
    result["cycles"] = cycles
    return result


class _NoWeights(EngineDefaults):
    """A real engine with its weight loading hidden: an engine the one call must refuse."""

    features = EngineFeatures(loads_weights=False)

    def __init__(self, engine: TransformersEngine) -> None:
        self._engine, self.name = engine, "no-update-weights"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self._engine.release(tags)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self._engine.resume(tags)

    def flush_cache(self) -> None:
        self._engine.flush_cache()

    def released(self) -> frozenset[EngineMemory]:
        return self._engine.released()

    def weight_version(self) -> int | None:
        return self._engine.weight_version()

    def is_idle(self) -> bool:
        return self._engine.is_idle()


def _writes_first_param(named: Iterable[Named], *, bucket_bytes: int) -> Iterator[Sequence[Named]]:
    """The Llama conversion, but it scales the embedding in place first: a converter's bug."""
    for name, tensor in named:
        if name == "embedding.word_embeddings.weight":
            tensor.mul_(2)
        yield from per_tensor(partial(to_hf, cfg=DENSE))([(name, tensor)], bucket_bytes=bucket_bytes)


def _not_a_llama() -> tuple[list[Any], Any]:
    """A real Megatron GPT that maps name for name onto a Llama but computes something else:
    LayerNorm, and RoPE rotating interleaved pairs rather than halves."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from orchestrator.adapters.megatron.build import _transformer_config

    config = dataclasses.replace(_transformer_config(DENSE.shape()), normalization="LayerNorm", rotary_interleaved=True)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
        vocab_size=DENSE.vocab_size,
        max_sequence_length=DENSE.seq_len,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    chunks = [DistributedDataParallel(config, ddp, Float16Module(config, gpt))]
    opt = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True)
    return chunks, get_megatron_optimizer(opt, chunks)


def embed_scenario() -> dict[str, Any]:
    """The one call on a dense Llama-shaped GPT: two cycles with the transformers engine, then what
    it refuses, each time with the engine untouched."""
    result: dict[str, Any] = {}
    chunks, optimizer = build_gpt(DENSE)
    engine = TransformersEngine(gpt_shape(chunks), max_batch=8, max_len=DENSE.seq_len)
    resident = engine.resident_bytes()

    # Refused before anything moves.
    result["megatron_flag"] = _refusal(lambda: colocate_megatron(chunks, optimizer, engine, distributed_optimizer=True))
    result["unknown_flag"] = _refusal(lambda: colocate_megatron(chunks, optimizer, engine, colocated=True))
    result["bad_mode"] = _refusal(lambda: colocate_megatron(chunks, optimizer, engine, "rematerialise"))
    result["no_update_weights"] = _refusal(lambda: colocate_megatron(chunks, optimizer, _NoWeights(engine)))
    chunks[0].ddp_config.overlap_param_gather = True  # as the user's DDP config would say it
    result["overlap_param_gather"] = _refusal(lambda: colocate_megatron(chunks, optimizer, engine))
    chunks[0].ddp_config.overlap_param_gather = False
    moe_chunks, moe_optimizer = build_gpt(TinyGPTConfig(num_experts=2))
    result["moe"] = _refusal(lambda: colocate_megatron(moe_chunks, moe_optimizer, engine))
    result["uncovered"] = _refusal(lambda: colocate_megatron(moe_chunks, moe_optimizer, engine, extras=()))
    result["not_llama"] = _refusal(lambda: colocate_megatron(*_not_a_llama(), engine))
    served = hf_config(gpt_shape(chunks)).to_dict()  # what the engine was built from
    other_theta = served | {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    result["served_other"] = _refusal(
        lambda: colocate_megatron(chunks, optimizer, engine, sync=Sync(served_config=other_theta))
    )
    result["served_missing"] = _refusal(
        lambda: colocate_megatron(chunks, optimizer, engine, sync=Sync(served_config="/nowhere"))
    )
    result["engine_untouched"] = engine.resident_bytes() == resident and engine.weight_version() is None

    # The cycle, as the example drives it.
    # one chunk, not in a list: taken as [chunk]; the config the engine serves agrees with the model
    lifecycle = colocate_megatron(chunks[0], optimizer, engine, sync=Sync(served_config=served))
    (tracing, *_) = lifecycle.listeners.listeners
    result["tracing_provider"] = type(tracing._provider).__name__ if isinstance(tracing, TracingListener) else None
    result["regions"] = type(lifecycle._regions._regions).__name__
    cycles = []
    for step in range(2):
        with lifecycle.step():
            lifecycle.pause_grads()
            lifecycle.update_weights()
            trainer_side = {}
            for name, tensor in chunks_sync(chunks, optimizer):
                trainer_side.update({n: t.to(torch.bfloat16) for n, t in to_hf(name, tensor, DENSE)})
            same = all(torch.equal(engine._params[n], t) for n, t in trainer_side.items())
            lifecycle.drop_params()
            lifecycle.rollout(
                partial(engine.generate, tokens(DENSE, step)[:, :4], max_new_tokens=4, temperature=1.0, seed=0)
            )
            lifecycle.restore()
            lifecycle.train(partial(lm_step, chunks, optimizer, tokens(DENSE, 10 + step)))
        cycles.append(
            {
                "engine_has_trainer_weights": same,
                "version": engine.weight_version(),
                "verified": lifecycle.last_restore_verified,
            }
        )
    result["cycles"] = cycles

    # Backup mode through the same call: a pinned copy of the param buffer instead of the cast.
    backup = colocate_megatron(chunks, optimizer, TransformersEngine(gpt_shape(chunks), max_batch=8), Mode.BACKUP)
    with backup.step():
        backup.pause_grads()
        backup.update_weights()
        backup.drop_params()
        backup.rollout()
        backup.restore()
    result["backup"] = {"verified": backup.last_restore_verified, "mode": backup.config.mode.value}

    # A converter that writes to a live param: the push raises, naming it, and the lifecycle faults.
    fresh = TransformersEngine(gpt_shape(chunks), max_batch=8, max_len=DENSE.seq_len)  # the first one is taken
    writing = colocate_megatron(chunks, optimizer, fresh, sync=Sync(convert=_writes_first_param))
    writing.pause_grads()
    try:
        writing.update_weights()
    except ActionFailed as error:
        cause = error.__cause__
        result["written"] = {
            "cause": type(cause).__name__,
            "names": list(cause.names) if isinstance(cause, SyncTensorWritten) else None,
            "message": str(cause),
            "phase": writing.phase.value,
            "engine_version": fresh.weight_version(),
        }
    result["faulted"] = Phase.FAULTED.value
    return result


def after_effect_scenario() -> dict[str, Any]:
    """colocate_megatron on real megatron-core (StorageRegions, the transformers engine): each call
    takes effect and then raises, once, in turn; recover; then a whole cycle. Replaced: the one
    call that raises (the adapter's own method, wrapped to run and then raise), and for the step
    that raised, the DistributedOptimizer's `_copy_main_params_to_model_params` (once)."""
    from tests.support.inject import Timeout, after_effect
    from tests.support.megatron_ranks import params_off_their_mains

    chunks, optimizer = build_gpt(DENSE)
    engine = TransformersEngine(gpt_shape(chunks), max_batch=8, max_len=DENSE.seq_len)
    lc = colocate_megatron(chunks, optimizer, engine)
    regions = lc._regions._regions  # the StorageRegions the call chose

    def cycle(step: int) -> dict[str, Any]:
        with lc.step():
            lc.pause_grads()
            lc.update_weights()
            synced = [
                (n, t.to(torch.bfloat16))
                for name, t in chunks_sync(chunks, optimizer)
                for n, t in to_hf(name, t, DENSE)
            ]
            same = all(torch.equal(engine._params[n], t) for n, t in synced)  # read while the engine holds them
            lc.drop_params()
            lc.rollout(partial(engine.generate, tokens(DENSE, step)[:, :4], max_new_tokens=2, temperature=1.0, seed=0))
            lc.restore()
            lc.train(partial(lm_step, chunks, optimizer, tokens(DENSE, 10 + step)))
        return {"engine_has_trainer_weights": same}

    def step_raises_after_the_inner_step() -> None:
        (distributed,) = optimizer.chained_optimizers

        def cast_fails() -> None:
            del distributed._copy_main_params_to_model_params
            raise Timeout("injected: the cast after the inner step")

        distributed._copy_main_params_to_model_params = cast_fails
        lm_step(chunks, optimizer, tokens(DENSE, 99))

    kv, to_rollout = EngineMemory.KV_CACHE, ("pause_grads", "update_weights", "drop_params", "rollout")
    # name: (the call made to take effect and then raise, the events before the one that fails, that event)
    faults: dict[str, tuple[Callable[[], None], tuple[str, ...], Callable[[], Any]]] = {
        "A: a region resume": (lambda: after_effect(regions, "resume", lambda t: t == Region.DEFAULT), to_rollout, lc.restore),
        "B: a region pause": (lambda: after_effect(regions, "pause", lambda t: t == Region.PARAM_BUFFER), to_rollout[:2], lc.drop_params),
        "C: an engine release": (lambda: after_effect(engine, "release"), to_rollout, lc.restore),
        "D: an engine resume": (lambda: after_effect(engine, "resume", lambda tags: kv in tags), to_rollout[:3], lc.rollout),
        "E: an optimizer step": (lambda: None, (), lambda: lc.train(step_raises_after_the_inner_step)),
    }  # fmt: skip
    result: dict[str, Any] = {"first": cycle(0)}
    for index, (name, (inject, before, failing)) in enumerate(faults.items()):
        inject()
        for event in before:
            getattr(lc, event)()
        try:
            failing()
            raised = None
        except ActionFailed as error:
            raised = f"{type(error.cause).__name__}: {error.cause}"
        lc.recover()
        result[name] = {
            "raised": raised,
            "phase": lc.phase.value,
            "paused": sorted(regions.paused),
            "engine_released": sorted(engine.released()),
            "params_off_their_mains": params_off_their_mains(MegatronTrainer(chunks, optimizer), optimizer),
            **cycle(1 + index),
        }
    return result


def chunks_sync(chunks: Any, optimizer: Any) -> list[Named]:
    """What a sync reads right now (params only: a dense model has no extras)."""
    return [(n, t) for n, t in MegatronTrainer(chunks, optimizer).sync_tensors()]


def deprecated_scenario() -> dict[str, Any]:
    """The flat keywords of the release before the option groups: each still taken, into its group,
    with a DeprecationWarning naming the group; then a whole cycle."""
    import warnings

    chunks, optimizer = build_gpt(DENSE)
    engine = TransformersEngine(gpt_shape(chunks), max_batch=8, max_len=DENSE.seq_len)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lc = colocate_megatron(chunks, optimizer, engine, verify_cycles=1, bucket_bytes=1 << 16, offload="always")
    with lc.step():
        lc.pause_grads()
        lc.update_weights()
        lc.drop_params()
        lc.rollout(partial(engine.generate, tokens(DENSE, 0)[:, :4], max_new_tokens=2, temperature=1.0, seed=0))
        lc.restore()
        lc.train(partial(lm_step, chunks, optimizer, tokens(DENSE, 10)))
    return {
        "warnings": [(w.category.__name__, str(w.message), Path(w.filename).name) for w in caught],
        "taken": [lc.config.verify_cycles, lc._actions._transport._bucket_bytes, str(lc.config.offload)],
        "version": engine.weight_version(),
        "verified": lc.last_restore_verified,
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "extras_written": extras_written_scenario,
    # One spawn for both: megatron's import is most of a spawn's time.
    "embed": lambda: embed_scenario() | {"after_effect": after_effect_scenario(), "deprecated": deprecated_scenario()},
}


def rank_main(rank: int, world_size: int, port: int, out: str, scenario: str) -> None:
    path = Path(out) / f"rank{rank}.json"
    try:
        init_process_group(rank, world_size, port, "nccl" if torch.cuda.is_available() else "gloo")
        result = SCENARIOS[scenario]()
        destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    path.write_text(json.dumps(result))
