"""gloo ranks for checkpoints in the embedding: real megatron-core at DP=2 on the CPU path, one real
transformers engine in rank 0's process that both ranks reach (tests/support/embed_parallel_ranks.py).

`unbroken`: 4 steps through `colocate_megatron(checkpoint=Checkpoint(save_dir=, save_every=2))`. `resumed` (a fresh pair):
a damaged copy of step 2 refused, then step 2 resumed and steps 3-4 trained again; then rank 0
alone, a world of one (DP=1), resumes the unbroken run's last checkpoint (step 4). Each records
SHA256 of its model params, fp32 mains and Adam moments (its own shards) where the test compares.
"""

from __future__ import annotations

import json
import shutil
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch

from orchestrator import Checkpoint, ConfigError, colocate_megatron
from orchestrator.adapters.digest import sha256_digests
from orchestrator.adapters.megatron.build import TinyGPTConfig, build_gpt, destroy_process_group, init_process_group
from orchestrator.adapters.megatron.build import train_step as lm_step
from orchestrator.adapters.megatron.checkpointing import MegatronCheckpointer
from orchestrator.adapters.megatron.embed import gpt_shape
from states import Mode
from tests.support.embed_parallel_ranks import RemoteEngine, SharedEngine, _connect, _generate_then_wait, _share
from tests.support.spawn import free_port

DENSE = TinyGPTConfig()
STEPS, EVERY = 4, 2


def _tokens(step: int) -> torch.Tensor:
    """This rank's batch of `step`: a function of the two alone, as a resumable sampler's is."""
    seed = 1000 * torch.distributed.get_rank() + step
    return torch.randint(0, DENSE.vocab_size, (8, DENSE.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def digests(chunks: list[Any], optimizer: Any, *, optimizer_state: bool = True) -> dict[str, str]:
    """SHA256 of every model param, and of this rank's fp32 main shards and Adam moments and steps."""
    tensors = {f"param/{n}": p.detach() for n, p in chunks[0].module.named_parameters()}
    if optimizer_state:
        for i, inner in enumerate(optimizer.chained_optimizers):
            for g, group in enumerate(inner.optimizer.param_groups):
                for k, main in enumerate(group["params"]):
                    tensors[f"main/{i}.{g}.{k}"] = main.detach()
                    for key, value in inner.optimizer.state[main].items():
                        tensors[f"{key}/{i}.{g}.{k}"] = torch.as_tensor(value)
    return sha256_digests({n: t.contiguous() for n, t in tensors.items()})


def _engine(chunks: list[Any]) -> SharedEngine | RemoteEngine:
    """Rank 0's engine, or this rank's handle on it."""
    if torch.distributed.get_rank() == 0:
        engine = SharedEngine(gpt_shape(chunks), max_batch=8, max_len=DENSE.seq_len)
        address = [_share(engine)]
    else:
        address = [None]
    torch.distributed.broadcast_object_list(address, src=0)
    return engine if torch.distributed.get_rank() == 0 else _connect(address[0])


def _step(lifecycle: Any, engine: Any, chunks: list[Any], optimizer: Any, step: int) -> int | None:
    """One cycle through the lifecycle; the version the engine serves after its sync."""
    with lifecycle.step(step):
        lifecycle.pause_grads()
        lifecycle.update_weights()
        version = engine.weight_version()
        lifecycle.drop_params()
        if isinstance(engine, SharedEngine):
            lifecycle.rollout(partial(_generate_then_wait, engine, _tokens(step)[:, :4], step))
        else:
            lifecycle.rollout(torch.distributed.barrier)
        lifecycle.restore()
        lifecycle.train(partial(lm_step, chunks, optimizer, _tokens(step)))
    return version


def unbroken(out: Path) -> dict[str, Any]:
    chunks, optimizer = build_gpt(DENSE)
    engine = _engine(chunks)
    position = {"next_step": 1}
    saving = Checkpoint(save_dir=out / "ckpt", save_every=EVERY, state=lambda: dict(position))
    lifecycle = colocate_megatron(chunks, optimizer, engine, checkpoint=saving)
    result: dict[str, Any] = {"versions": [], "digests": {}}
    for step in range(1, STEPS + 1):
        position["next_step"] = step + 1
        result["versions"].append(_step(lifecycle, engine, chunks, optimizer, step))
        if step % EVERY == 0:
            result["digests"][str(step)] = digests(chunks, optimizer)
    result["saved"] = sorted(p.name for p in (out / "ckpt").iterdir())
    torch.distributed.barrier()  # rank 0 serves the engine until every rank is done with it
    return result


def _damaged_copy(out: Path) -> str:
    """Step 2's checkpoint, copied with its largest shard cut short; the file's path."""
    copy = out / "damaged" / "step-000002"
    shutil.copytree(out / "ckpt" / "step-000002", copy)
    shard = max((p for p in (copy / "trainer").iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-100])
    return str(shard)


def resumed(out: Path) -> dict[str, Any]:
    chunks, optimizer = build_gpt(DENSE)
    engine = _engine(chunks)
    result: dict[str, Any] = {}
    truncated = [None]
    if torch.distributed.get_rank() == 0:
        truncated = [_damaged_copy(out)]
        shutil.copytree(out / "ckpt" / "step-000002", out / "resume" / "step-000002")
    torch.distributed.broadcast_object_list(truncated, src=0)  # also: the copies are made
    result["truncated"] = truncated[0]
    before = digests(chunks, optimizer)
    try:
        colocate_megatron(chunks, optimizer, engine, checkpoint=Checkpoint(resume=out / "damaged"))
        result["refused"] = None
    except ConfigError as error:
        result["refused"] = f"{type(error).__name__}: {error}"
    result["untouched"] = digests(chunks, optimizer) == before

    # A save whose directory rank 0 cannot make (a file is in the way): every rank raises.
    (out / "a-file").touch()
    failing = MegatronCheckpointer(chunks, optimizer, save_dir=out / "a-file", every=1)
    try:
        failing.save(1, 0)
        result["save_failed"] = None
    except Exception as error:
        result["save_failed"] = f"{type(error).__name__}: {error}"

    position: dict[str, Any] = {}
    lifecycle = colocate_megatron(
        chunks,
        optimizer,
        engine,
        checkpoint=Checkpoint(
            save_dir=out / "resume", save_every=EVERY, resume=out / "resume", state=lambda: dict(position)
        ),
    )
    point = lifecycle.checkpointer.resumed
    result["point"] = {"step": point.step, "weight_version": point.weight_version, "state": point.state}
    result["point"] |= {"resharded": point.resharded, "path": point.path}
    position.update(point.state)
    result["versions"] = []
    for step in range(point.step + 1, STEPS + 1):
        position["next_step"] = step + 1
        result["versions"].append(_step(lifecycle, engine, chunks, optimizer, step))
    result["digests"] = digests(chunks, optimizer)
    torch.distributed.barrier()
    return result


def one_rank(out: Path, saved: dict[str, str]) -> dict[str, Any]:
    """Rank 0 alone (DP=1) resumes the DP=2 run's last checkpoint, train-only; then another
    model (another FFN width) tries to."""
    chunks, optimizer = build_gpt(DENSE)
    lifecycle = colocate_megatron(chunks, optimizer, None, Mode.TRAIN_ONLY, checkpoint=Checkpoint(resume=out / "ckpt"))
    point = lifecycle.checkpointer.resumed
    params = digests(chunks, optimizer, optimizer_state=False)
    expected = {n: d for n, d in saved.items() if n.startswith("param/")}
    with lifecycle.step(point.step + 1):
        stats = lifecycle.train(partial(lm_step, chunks, optimizer, _tokens(point.step + 1)))
    other, other_optimizer = build_gpt(TinyGPTConfig(ffn_hidden_size=96))  # another model
    try:
        colocate_megatron(other, other_optimizer, None, Mode.TRAIN_ONLY, checkpoint=Checkpoint(resume=out / "ckpt"))
        another: str | None = None
    except ConfigError as error:
        another = f"{type(error).__name__}: {error}"
    return {
        "another_model": another,
        "step": point.step,
        "resharded": point.resharded,
        "params_equal": params == expected,
        "trained": stats.update_successful and digests(chunks, optimizer, optimizer_state=False) != params,
    }


def rank_main(rank: int, world_size: int, port: int, out: str, scenario: str) -> None:
    path = Path(out) / f"rank{rank}.json"
    try:
        init_process_group(rank, world_size, port)
        if scenario == "unbroken":
            result = unbroken(Path(out))
            destroy_process_group()
        else:
            result = resumed(Path(out))
            destroy_process_group()
            if rank == 0:
                init_process_group(0, 1, free_port())
                saved = json.loads((Path(out) / "step4.json").read_text())
                result["one_rank"] = one_rank(Path(out), saved)
                destroy_process_group()
    except BaseException:
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    path.write_text(json.dumps(result))
