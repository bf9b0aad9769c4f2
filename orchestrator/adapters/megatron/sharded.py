"""A Megatron trainer's model, optimizer and RNG, saved and loaded with Megatron's own
distributed checkpointing (`megatron.core.dist_checkpointing`, torch_dist format).

    save(chunks, optimizer, directory)              # every rank, collectively
    load(chunks, optimizer, directory, rng=True)    # every rank, collectively

The optimizer is saved `dp_reshardable`: every data-parallel rank writes its own shard of the
fp32 mains and Adam moments, no rank gathers, and a checkpoint saved at one data-parallel size
loads at another. The model's params are written once across replicas. Each rank's RNG states
(torch's, and Megatron's tracker) are a per-rank object: restored where the world size is the
one saved (`rng=True`), and left as they are otherwise.

Two facts of megatron-core (0.16.1) this module handles:
- `DistributedOptimizer.state_dict()` reads the Adam step from the optimizer's state, so an
  optimizer that never stepped has none to read: `load` gives it zeroed moments and step first,
  with Megatron's own `init_state_fn`, without running a step (which would count as one).
- Loading into torch's Adam (no Apex or Transformer Engine), Megatron sets one step tensor on
  every param's state, and then copies the loading side's own step into it with the moments
  (`_set_main_param_and_optimizer_states`): the step loaded is the one the optimizer had before
  the load, shared, so torch's Adam increments it once per param per step. The bias correction
  is wrong from the first step on, and a resumed run is no longer an unbroken one's. `load` sets
  each param's step, its own tensor, from its param group's, which is the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from orchestrator.adapters.megatron.build import init_optimizer_state

__all__ = ["load", "save"]

# How the distributed optimizer lays its state out in the checkpoint (see the module docstring).
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
_RNG = "rng_state"


def _module(chunk: Any) -> Any:
    """The GPT inside its wrappers (DDP, Float16Module): what Megatron's checkpoints name."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_key(index: int, chunks: Sequence[Any]) -> str:
    return "model" if len(chunks) == 1 else f"model{index}"  # Megatron-LM's names, one per virtual stage


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _sharded(chunks: Sequence[Any], optimizer: Any, *, loading: bool, rng: bool) -> dict[str, Any]:
    state: dict[str, Any] = {}
    model: dict[str, Any] = {}
    for index, chunk in enumerate(chunks):
        state[_model_key(index, chunks)] = chunk_state = _module(chunk).sharded_state_dict()
        model.update(chunk_state)
    state["optimizer"] = optimizer.sharded_state_dict(model, is_loading=loading, metadata=_OPTIMIZER_FORMAT)
    if rng:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        state[_RNG] = ShardedObject(_RNG, _rng_states(), (world,), (rank,), replica_id=0)
    return state


def save(chunks: Sequence[Any], optimizer: Any, directory: Path) -> None:
    """Write this rank's part of the checkpoint into `directory` (an empty one every rank sees)."""
    dist_checkpointing.save(_sharded(chunks, optimizer, loading=False, rng=True), str(directory))


def _steps_from_groups(optimizer: Any) -> None:
    """Each param's Adam step, its own tensor, from its group's (loaded from the checkpoint)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if "step" in state and "step" in group:  # torch's Adam keeps it per param; fused ones per group
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def load(chunks: Sequence[Any], optimizer: Any, directory: Path, *, rng: bool) -> None:
    """Load the checkpoint in `directory` into the model and the optimizer (and this rank's RNG
    states, if `rng`); raises Megatron's CheckpointingException where it does not fit the model."""
    init_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded(chunks, optimizer, loading=True, rng=rng), str(directory))
    for index, chunk in enumerate(chunks):
        _module(chunk).load_state_dict(loaded[_model_key(index, chunks)])
    optimizer.load_state_dict(loaded["optimizer"])
    _steps_from_groups(optimizer)
    if rng:
        _set_rng_states(loaded[_RNG])
