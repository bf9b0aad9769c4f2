"""What one checkpoint save stages in host memory on each node, as Megatron chooses its writers.

`dist_checkpointing.save` (torch_dist, no fully-parallel wrapper: `adapters/megatron/sharded.py`)
has each tensor written by the one rank whose replica id is all zeros, and that rank copies it
to host memory first. So, on a rank at (stage, TP rank, DP rank, expert-DP rank):

- its optimizer shard, always: the distributed optimizer's `dp_reshardable` state is every DP
  rank's own (`RankBytes.optimizer_shard`, DP rank 0's part, the largest);
- its dense params, at DP rank 0 only; a tensor replicated over TP (norms, routers, MLA's down
  projections under the TE spec) at TP rank 0 only;
- its experts' params, at expert-DP rank 0 only;
- never the last stage's embedding copy (the first stage saves it).

Ranks are in Megatron's order (`initialize_model_parallel`'s default `tp-cp-ep-dp-pp`): PP
outermost, and within a stage TP fastest, then DP; for experts, expert TP fastest, then EP, then
expert DP. A sum of `Plan.checkpoint_written` over a node's ranks would count the model once per
DP replica: this counts each tensor on its one writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.plan.memory import Plan
from orchestrator.plan.model import stage_tensors


@dataclass(frozen=True, slots=True)
class StageWrites:
    """Bytes of one stage's params, by who writes them."""

    dense: int  # dense params a TP rank 0 holds (DP rank 0 writes them)
    tp_replicated: int  # of which replicated over TP: TP rank 0 writes them, the others do not
    experts: int  # expert params one rank holds (expert-DP rank 0 writes them)


def stage_writes(p: Plan, stage: int) -> StageWrites:
    par, m = p.parallel, p.model
    layers = par.stages(m)[stage]
    where = {"first": stage == 0, "last": stage == par.pp - 1, "ep": par.ep, "etp": par.etp, "spec": par.spec}
    tensors = [t for t in stage_tensors(m, layers, tp=par.tp, **where) if not t.copy]  # type: ignore[arg-type]
    # A tensor TP leaves whole has the numel it has without TP (a split one, the embedding
    # included, is smaller: the vocabulary is padded for TP, then split).
    whole = {t.name: t.numel for t in stage_tensors(m, layers, tp=1, **where)}  # type: ignore[arg-type]
    dense = [t for t in tensors if not t.expert]
    replicated = [t for t in dense if par.tp > 1 and whole.get(t.name) == t.numel]
    return StageWrites(
        dense=sum(t.nbytes for t in dense),
        tp_replicated=sum(t.nbytes for t in replicated),
        experts=sum(t.nbytes for t in tensors if t.expert),
    )


def rank_written(p: Plan, rank: int, writes: list[StageWrites]) -> tuple[int, int]:
    """(model, optimizer) bytes rank `rank` (global, Megatron's order) stages for one save."""
    par = p.parallel
    per_stage = par.world // par.pp
    stage, local = divmod(rank, per_stage)
    tp_rank, dp_rank = local % par.tp, local // par.tp
    expert_dp_rank = local // (par.etp * par.ep)
    w = writes[stage]
    model = 0
    if dp_rank == 0:
        model += w.dense - (w.tp_replicated if tp_rank else 0)
    if expert_dp_rank == 0:
        model += w.experts
    return model, p.ranks[stage].optimizer_shard


def node_written(p: Plan) -> list[int]:
    """Host bytes one save stages on each node (`Plan.node_totals`' nodes), at most."""
    writes = [stage_writes(p, s) for s in range(p.parallel.pp)]
    world, per_node = p.parallel.world, p.gpus_per_node
    return [
        sum(sum(rank_written(p, r, writes)) for r in range(n * per_node, min((n + 1) * per_node, world)))
        for n in range(math.ceil(world / per_node))
    ]
