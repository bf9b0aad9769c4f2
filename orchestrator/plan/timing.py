"""Seconds per lifecycle phase and rank, from the bytes each rank moves over each link.

Each phase is a list of terms in series, each one link's bytes over its rate (`LinkRates`); the
term that takes longest bounds the phase. The bytes are the plan's (`memory.py`: what each region
holds and `offload.py`'s `copied_bytes`: what a pause copies), and the tensors of a stage
(`model.stage_tensors`) for what the update gathers. Per phase, one rank of the stage:

- pause_grads: `default` (the fp32 mains and Adam moments) to the host where it moves; the stash:
  the extras (rematerialize) or every bf16 param (backup), to the host.
- update_weights: the TP gather of the dense tensors (and the expert-TP gather of the experts),
  which the conversion to HF needs whole; then each engine GPU receives its share of the model
  (`Plan.engine_weights`), a uniform slice of every tensor: by a device copy from its own GPU, by
  NVLink from the GPUs of its node, by InfiniBand from the rest.
- drop_params: nothing crosses a link (the param buffer is paused without a copy).
- restore: `default` back from the host where it moved; then the cast (reads the fp32 mains,
  writes bf16) and the param all-gather over DP (expert DP for experts), or in backup mode the
  bf16 params from the host; the extras from the host.
- the moments' stream (issue 40, item 1, not built yet): Adam's moments back from the host under
  the forward and backward pass; visible is what the pass does not hide.

A group's link is NVLink where all of it sits on one node, else InfiniBand; ranks are numbered
as Megatron's default order numbers them (TP innermost, then DP, then PP; in a stage's expert
ranks, expert TP, then EP, then expert DP). Not modelled: mapping and unmapping device memory
(torch_memory_saver's pause and resume), the engine's release and resume of its memory,
per-tensor Python and launches. A phase with nothing to copy is predicted at 0 s.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.plan.figures import Link, LinkRates
from orchestrator.plan.memory import GB, Plan, RankBytes
from orchestrator.plan.model import Kind, Tensor, stage_tensors
from orchestrator.plan.offload import copied_bytes
from states import Mode, Region

PHASES = ("pause_grads", "update_weights", "drop_params", "restore")
NOT_MODELLED = "not modelled: mapping device memory, the engine's release, per-tensor work"


@dataclass(frozen=True, slots=True)
class Term:
    """One link's bytes for one rank, and the seconds they take at its rate."""

    what: str
    link: Link
    bytes: int
    gbps: float

    @property
    def seconds(self) -> float:
        return self.bytes / (self.gbps * 1e9)

    def says(self) -> str:
        return f"{self.link}: {self.bytes / GB:,.2f} GB at {self.gbps:,g} GB/s ({self.what})"


@dataclass(frozen=True, slots=True)
class PhaseTime:
    name: str
    terms: tuple[Term, ...]

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.terms)

    @property
    def bound(self) -> Term | None:
        """The term that takes longest; None where nothing crosses a link."""
        return max(self.terms, key=lambda t: t.seconds) if self.terms else None


@dataclass(frozen=True, slots=True)
class MomentsStream:
    """Adam's moments back from the host while train runs forward and backward (issue 40, item 1)."""

    term: Term | None  # None: nothing to stream (they stay on the device, or no Adam)
    train_seconds: float | None  # the forward + backward it hides under; None: unknown

    @property
    def seconds(self) -> float:
        return self.term.seconds if self.term else 0.0

    @property
    def visible(self) -> float | None:
        """Seconds of the stream no training hides; None where the train's seconds are unknown."""
        if self.term is None:
            return 0.0
        return None if self.train_seconds is None else max(0.0, self.seconds - self.train_seconds)


@dataclass(frozen=True, slots=True)
class StageTime:
    """One stage's phases, at its slowest rank."""

    stage: int
    rank: int  # the global rank whose phases these are
    phases: dict[str, PhaseTime]
    moments: MomentsStream

    @property
    def restore_with_stream(self) -> float:
        """restore's seconds once the moments stream under training: the copy of the mains alone."""
        return self.phases["restore"].seconds - self.moments.seconds


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a rank's groups sit: Megatron's default order, `gpus_per_node` GPUs to a node."""

    tp: int
    dp: int
    ep: int
    etp: int
    gpus_per_node: int

    @property
    def stage_ranks(self) -> int:
        return self.tp * self.dp

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def groups(self, rank: int) -> dict[str, list[int]]:
        base, local = divmod(rank, self.stage_ranks)
        base *= self.stage_ranks
        dp_rank, tp_rank = divmod(local, self.tp)
        expert = self.ep * self.etp
        in_expert = local % expert
        etp_base = local - local % self.etp
        return {
            "tp": [base + dp_rank * self.tp + t for t in range(self.tp)],
            "dp": [base + d * self.tp + tp_rank for d in range(self.dp)],
            "etp": [base + etp_base + t for t in range(self.etp)],
            "expert_dp": [base + x * expert + in_expert for x in range(self.stage_ranks // expert)],
        }

    def ep_rank(self, rank: int) -> int:
        return (rank % self.stage_ranks) % (self.ep * self.etp) // self.etp

    def link(self, rank: int, group: list[int]) -> Link:
        return Link.NVLINK if {self.node(g) for g in group} == {self.node(rank)} else Link.IB


@dataclass(frozen=True, slots=True)
class _StageBytes:
    """bf16 bytes of one stage's trainable tensors: one rank's shard and the stage's whole."""

    dense: int
    expert: int
    dense_whole: int
    expert_whole: int


def _param_bytes(tensors: list[Tensor], expert: bool) -> int:
    return sum(2 * t.numel for t in tensors if t.expert is expert and t.kind is not Kind.EXPERT_BIAS)


def _stage_bytes(p: Plan) -> list[_StageBytes]:
    m, par = p.model, p.parallel
    out = []
    for s, layers in enumerate(par.stages(m)):
        first, last = s == 0, s == par.pp - 1
        own = stage_tensors(m, layers, first=first, last=last, tp=par.tp, ep=par.ep, etp=par.etp, spec=par.spec)
        whole = stage_tensors(m, layers, first=first, last=last, tp=1, ep=1, etp=1, spec=par.spec)
        out.append(_StageBytes(_param_bytes(own, False), _param_bytes(own, True), _param_bytes(whole, False),
                               _param_bytes(whole, True)))  # fmt: skip
    return out


def _pause_grads(p: Plan, r: RankBytes, keep: frozenset[Region], rates: LinkRates) -> list[Term]:
    out = []
    if Region.DEFAULT not in keep and copied_bytes(p, r, Region.DEFAULT):
        out.append(_term("fp32 mains + Adam moments", Link.TO_HOST, copied_bytes(p, r, Region.DEFAULT), rates))
    if p.mode is Mode.BACKUP:
        out.append(_term("stash: every bf16 param", Link.TO_HOST, copied_bytes(p, r, Region.PARAM_BUFFER), rates))
    elif r.extras:
        out.append(_term("stash: the extras", Link.TO_HOST, r.extras, rates))
    return out


def _update(p: Plan, rank: int, lay: _Layout, stages: list[_StageBytes], rates: LinkRates) -> list[Term]:
    s, groups = rank // lay.stage_ranks, lay.groups(rank)
    mine, out = stages[s], []
    if lay.tp > 1:
        link = lay.link(rank, groups["tp"])
        out.append(_term("TP gather of the dense tensors", link, mine.dense_whole - mine.dense, rates))
    if lay.etp > 1 and mine.expert:
        link = lay.link(rank, groups["etp"])
        out.append(_term("expert-TP gather of the experts", link, mine.expert * (lay.etp - 1), rates))
    whole = sum(b.dense_whole + b.expert_whole for b in stages)
    self_share = (mine.dense_whole + mine.expert * lay.etp) / whole
    node_share = _node_share(rank, lay, stages) / whole
    w = p.engine_weights
    shares = ((Link.DEVICE, self_share), (Link.NVLINK, node_share - self_share), (Link.IB, 1 - node_share))
    for link, share in shares:
        if round(w * share) > 0:
            out.append(_term("the engine's share of the model", link, round(w * share), rates))
    return out


def _node_share(rank: int, lay: _Layout, stages: list[_StageBytes]) -> int:
    """Distinct bytes of the whole model the GPUs of `rank`'s node hold, once gathered over TP and
    expert TP: each stage present whole in its dense part, each EP shard of its experts present."""
    node = lay.node(rank)
    on_node = range(node * lay.gpus_per_node, (node + 1) * lay.gpus_per_node)
    pieces: set[tuple[int, int]] = set()
    for g in on_node:
        s = g // lay.stage_ranks
        if s < len(stages):
            pieces |= {(s, -1), (s, lay.ep_rank(g))}
    return sum(stages[s].dense_whole if e < 0 else stages[s].expert_whole // lay.ep for s, e in pieces)


def _restore(
    p: Plan, r: RankBytes, rank: int, lay: _Layout, keep: frozenset[Region], rates: LinkRates, mine: _StageBytes
) -> list[Term]:
    out = []
    if Region.DEFAULT not in keep and copied_bytes(p, r, Region.DEFAULT):
        out.append(_term("fp32 mains + Adam moments", Link.FROM_HOST, copied_bytes(p, r, Region.DEFAULT), rates))
    if p.mode is Mode.BACKUP:
        out.append(_term("every bf16 param", Link.FROM_HOST, copied_bytes(p, r, Region.PARAM_BUFFER), rates))
        return out
    # The cast reads 4 bytes a param and writes 2: as a copy (reads n, writes n) of 3 bytes a param.
    out.append(_term("cast: fp32 mains -> bf16", Link.DEVICE, (r.mains + r.mains // 2) // 2, rates))
    groups = lay.groups(rank)
    for what, size, group, n in (
        ("param all-gather over DP", lay.dp, groups["dp"], mine.dense),
        ("expert param all-gather over expert DP", len(groups["expert_dp"]), groups["expert_dp"], mine.expert),
    ):
        if size > 1 and n:
            out.append(_term(what, lay.link(rank, group), n * (size - 1) // size, rates))
    if r.extras:
        out.append(_term("the extras", Link.FROM_HOST, r.extras, rates))
    return out


def _term(what: str, link: Link, n: int, rates: LinkRates) -> Term:
    return Term(what, link, n, rates.gbps(link))


def predict(
    p: Plan,
    rates: LinkRates | None = None,
    *,
    train_seconds: float | None = None,
    keep: frozenset[Region] | None = None,
) -> list[StageTime]:
    """Each stage's phases at its slowest rank. `train_seconds`: one step's forward + backward, to
    say how much of the moments' stream it hides (None: unknown). `keep`: the regions that stay on
    the device through the rollout (default: the plan's offload choice)."""
    rates = rates or LinkRates()
    par = p.parallel
    lay = _Layout(tp=par.tp, dp=par.dp, ep=par.ep, etp=par.etp, gpus_per_node=p.gpus_per_node)
    stages = _stage_bytes(p)
    out = []
    for r in p.ranks:
        kept = p.kept(r) if keep is None else keep
        candidates = []
        for rank in range(r.stage * lay.stage_ranks, (r.stage + 1) * lay.stage_ranks):
            phases = {
                "pause_grads": PhaseTime("pause_grads", tuple(_pause_grads(p, r, kept, rates))),
                "update_weights": PhaseTime("update_weights", tuple(_update(p, rank, lay, stages, rates))),
                "drop_params": PhaseTime("drop_params", ()),
                "restore": PhaseTime("restore", tuple(_restore(p, r, rank, lay, kept, rates, stages[r.stage]))),
            }
            candidates.append((sum(x.seconds for x in phases.values()), rank, phases))
        _, rank, phases = max(candidates, key=lambda c: c[0])
        moves = Region.DEFAULT not in kept and r.adam > 0
        stream = _term("Adam moments", Link.FROM_HOST, r.adam, rates) if moves else None
        out.append(StageTime(r.stage, rank, phases, MomentsStream(stream, train_seconds)))
    return out
