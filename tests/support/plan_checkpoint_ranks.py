"""One gloo rank that saves a real distributed checkpoint of the `cpu` benchmark GPT, for the
planner's checkpoint rows: it builds the model in DDP + DistributedOptimizer, trains one step (so
Adam's moments exist), saves the model and the optimizer as colocate does, with
`dist_checkpointing.save` (torch_dist) and the optimizer's `dp_reshardable` state, and writes
`rank<N>.json`: the bytes of its own `.distcp` files and, on rank 0, the tensor bytes the
checkpoint's metadata lists, model and optimizer apart.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def rank(r: int, world: int, port: int, out: str, ep: int) -> None:
    try:
        result = _save(r, world, port, Path(out), ep)
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out, f"rank{r}.json").write_text(json.dumps(result))


def _save(r: int, world: int, port: int, out: Path, ep: int) -> dict[str, Any]:
    import torch
    from megatron.core import dist_checkpointing

    from orchestrator.adapters.megatron.build import build_gpt, destroy_process_group, init_process_group, train_step
    from orchestrator.job.presets import benchmark_model

    init_process_group(r, world, port, "gloo", expert_model_parallel_size=ep)
    cfg = benchmark_model("cpu")
    chunks, optimizer = build_gpt(cfg)
    train_step(chunks, optimizer, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1)))
    gpt = chunks[0].module.module  # DDP -> Float16Module -> GPTModel
    model = gpt.sharded_state_dict()
    state = {
        "model": model,
        "optimizer": optimizer.sharded_state_dict(model, metadata={"distrib_optim_sharding_type": "dp_reshardable"}),
    }
    folder = out / "checkpoint"
    if r == 0:
        folder.mkdir()
    torch.distributed.barrier()
    dist_checkpointing.save(state, str(folder))
    torch.distributed.barrier()
    result: dict[str, Any] = {"distcp": sum(f.stat().st_size for f in folder.glob(f"__{r}_*.distcp"))}
    if r == 0:
        result |= {"all_distcp": sum(f.stat().st_size for f in folder.glob("*.distcp")), **_listed(folder)}
    destroy_process_group()
    return result


def _listed(folder: Path) -> dict[str, int]:
    """Bytes of every tensor the checkpoint's metadata lists (numel x element size), by top key."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    listed = {"model_tensors": 0, "optimizer_tensors": 0}
    for key, meta in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            kind = "optimizer_tensors" if "optimizer.distributed." in key else "model_tensors"
            listed[kind] += meta.size.numel() * meta.properties.dtype.itemsize
    return listed
