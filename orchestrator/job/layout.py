"""The ranks' layout (`colocate run --tp --ep --pp`): the planner's `Parallelism`, and whether the
model and the run can take it, judged before any rank starts.

Megatron places tensor parallelism innermost: ranks 0..TP-1 are one TP group, and a rank's
data-parallel index is `rank // TP` (with PP = 1). The job's world is `--ranks`; DP is
`ranks / (TP x PP)`. Experts split over EP within the TP x DP ranks, each expert's FFN over
expert TP: TP where EP is 1 (as megatron-core's `initialize_model_parallel` leaves it), else 1,
so that EP can take the TP ranks (`--tp 2 --ep 2` on 2 ranks: each rank 2 of 4 experts, whole).

    layout = run_layout(ranks=4, tp=2)                  # Parallelism(tp=2, dp=2)
    problems = layout_problems(layout, model.shape(), ranks=4, vocab_size=model.vocab_size)
"""

from __future__ import annotations

from orchestrator.models import ModelShape
from orchestrator.plan.memory import Parallelism
from orchestrator.plan.model import LayerSpec

__all__ = ["describe", "given_sizes", "layout_problems", "model_parallel", "run_layout"]


def run_layout(*, ranks: int, tp: int = 1, pp: int = 1, ep: int = 1) -> Parallelism:
    """The layout of `ranks` ranks at TP x PP (DP: what is left of them, at least 1), with EP;
    the job builds the local layer spec (`adapters.megatron.specs`)."""
    dp = max(ranks // max(tp * pp, 1), 1)
    if ep == 1:  # expert TP left out: TP, as Megatron's default
        return Parallelism(tp=tp, pp=pp, dp=dp, ep=ep, spec=LayerSpec.LOCAL)
    return Parallelism(tp=tp, pp=pp, dp=dp, ep=ep, etp=1, spec=LayerSpec.LOCAL)


def describe(layout: Parallelism) -> str:
    """The layout as the summary and the report name it: "TP 2 x DP 1", "DP 2, EP 2"."""
    parts = [f"{name} {n}" for name, n in (("TP", layout.tp), ("PP", layout.pp)) if n > 1]
    text = " x ".join([*parts, f"DP {layout.dp}"])
    return text + (f", EP {layout.ep}" if layout.ep > 1 else "")


def given_sizes(layout: Parallelism) -> str:
    """The layout's options above 1, as a refusal names them: "--tp 2 --ep 2"."""
    return " ".join(f"--{name} {n}" for name, n in (("tp", layout.tp), ("pp", layout.pp), ("ep", layout.ep)) if n > 1)


def model_parallel(layout: Parallelism) -> bool:
    """Whether a rank holds only part of the model (TP, PP or EP above 1): its weight sync then
    gathers the rest from the others, a collective every rank joins."""
    return layout.tp * layout.pp * layout.ep > 1


def layout_problems(layout: Parallelism, shape: ModelShape, *, ranks: int, vocab_size: int) -> list[str]:
    """What keeps `ranks` ranks from training `shape` at `layout`, each naming what the run has:
    sizes below 1, ranks that do not split into TP x PP groups, PP (not in the job yet), and
    whatever the planner refuses of the model at that layout (`Parallelism.problems`: heads,
    query groups, FFN sizes over TP; experts over EP; ...), but what it refuses at 1 x 1 x 1 too
    (the job builds that already); and a vocabulary that does not split over TP (the job's GPT
    takes it unpadded, and Megatron's vocab-parallel embedding splits it evenly)."""
    sizes = {"--tp": layout.tp, "--pp": layout.pp, "--ep": layout.ep}
    problems = [f"{flag} must be at least 1, got {n}" for flag, n in sizes.items() if n < 1]
    if problems:
        return problems
    if layout.pp > 1:
        problems.append(
            f"--pp {layout.pp}: pipeline parallelism is not supported by colocate run yet "
            "(it needs Megatron's pipeline schedule); colocate_megatron supports it"
        )
    if ranks % (layout.tp * layout.pp):
        problems.append(
            f"--ranks {ranks}: {ranks} ranks do not split into groups of TP x PP = {layout.tp} x {layout.pp} "
            "(DP = ranks / (TP x PP) must be whole)"
        )
    elif layout.ep > 1 and not shape.num_experts:
        problems.append(f"--ep {layout.ep}: {shape.name or 'the model'} has no experts to split")
    elif layout.tp > 1 and shape.num_experts:
        problems.append(
            f"--tp {layout.tp}: {shape.name or 'the model'} has experts, and Megatron's MoE layers under TP need "
            "sequence parallelism, which colocate run does not set yet; split the experts with --ep instead"
        )
    else:
        trivial = set(Parallelism(spec=layout.spec).problems(shape))
        problems += [f"{given_sizes(layout)}: {p}" for p in layout.problems(shape) if p not in trivial]
    if vocab_size % layout.tp:
        problems.append(f"--tp {layout.tp}: the vocabulary ({vocab_size} ids) does not divide by TP ({layout.tp})")
    return problems
