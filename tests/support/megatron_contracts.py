"""The WeightTransport contracts on `MegatronTransport`, in a gloo world of one rank of its own.

Megatron's parallel state and the CPU path are process-wide, so the trainer lives in a spawned
process (`spawn_ranks`); each contract of `tests/support/contracts.py` runs there on a fresh
engine, and its outcome (None, or the failure's traceback) comes back by name.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the router's torch.compile costs ~9 s cold

from states import EngineMemory
from tests.support.contracts import TRANSPORTS
from tests.support.spawn import spawn_ranks
from tests.support.transport_cases import Recording, TransportCase


def _run_contracts() -> dict[str, Any]:
    from orchestrator.adapters.engines.transformers import TransformersEngine
    from orchestrator.adapters.megatron.build import TinyGPTConfig, build_gpt
    from orchestrator.adapters.megatron.convert import to_hf
    from orchestrator.adapters.megatron.embed import gpt_shape
    from orchestrator.adapters.megatron.trainer import MegatronTrainer
    from orchestrator.adapters.megatron.transport import MegatronTransport, per_tensor
    from orchestrator.errors import EngineError

    shape = TinyGPTConfig()
    chunks, optimizer = build_gpt(shape)
    trainer = MegatronTrainer(chunks, optimizer)

    @contextmanager
    def megatron_transport() -> Iterator[TransportCase]:
        engine = TransformersEngine(gpt_shape(chunks), max_batch=4, max_len=16, device="cpu")
        dtypes = {n: p.dtype for n, p in engine.model.named_parameters()}
        sink = Recording(engine)
        transport = MegatronTransport(
            trainer, sink, convert=per_tensor(partial(to_hf, cfg=shape)), bucket_bytes=16 << 10
        )

        def expected() -> dict[str, torch.Tensor]:
            return {
                hf: t.to(dtypes[hf]) for name, tensor in trainer.sync_tensors() for hf, t in to_hf(name, tensor, shape)
            }

        yield TransportCase(
            transport,
            engine,
            expected=expected,
            delivered=lambda: sink.received,
            forget=sink.forget,
            sources=lambda: list(trainer.sync_tensors()),
            refuse=lambda: engine.release(frozenset({EngineMemory.WEIGHTS})),
            refusal=EngineError,
            calls=lambda: sink.buckets,
        )

    outcomes: dict[str, Any] = {}
    for name, contract in TRANSPORTS.items():
        try:
            with megatron_transport() as case:
                contract(case)
            outcomes[name] = None
        except BaseException:
            outcomes[name] = traceback.format_exc()
    return outcomes


def _rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    from orchestrator.adapters.megatron.build import destroy_process_group, init_process_group

    path = Path(out) / f"rank{rank}.json"
    try:
        init_process_group(rank, world_size, port, "gloo")
        result = _run_contracts()
        destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    path.write_text(json.dumps(result))


def megatron_transport_outcomes(out: Path) -> dict[str, str | None]:
    """Each transport contract's outcome on `MegatronTransport`: None where it held."""
    (result,) = spawn_ranks(_rank_main, 1, out, timeout=180)
    return result
