"""How the whole-path tests judge transformers' logits against Megatron's (tests/integration/
test_families.py, tests/gpu/test_families_gpu.py); see `compare`.

Megatron and transformers compute the same function in bf16 with other kernels (fused QKV, the
order of reductions, where each rounds), so their logits differ by rounding that grows through
the layers. Discrete choices inside the model amplify it: an MoE router near a tie can pick another
expert in one than in the other, and a DSA indexer another key; that token's logits then move by
far more, and through attention those of the later tokens of its sequence. So:

- each side records every router's chosen experts and every indexer's chosen keys, with the
  scores and inputs they chose from (forward hooks: tests/support/routing.py,
  megatron_dsa.recorded_selections);
- a sequence is compared only up to its first token routed (or indexed) differently in any layer;
- that first choice apart, the only one both sides made from inputs that differ by rounding
  alone, must be a near-tie by the arithmetic: Megatron's margin there within `SIGMAS` standard
  deviations of what the two sides' bf16 rounding moves it by (tests/support/rounding.py); and
  so must every later choice apart whose inputs, though they read what an earlier one changed,
  drifted no further than rounding can make them (their drift is in the standard deviation);
- each compared token's worst |Δlogit| must be within each side's distance from the function both
  compute: transformers', measured against an fp32 copy of its model (`own_rounding`), and
  Megatron's, bounded by the rounding through the model's layers (`rounding.logit_tolerance`, from
  transformers' final hidden state and output weights). A dense model routes nothing: every token
  is compared.

A wrong mapping moves the compared tokens, or makes a choice apart where rounding cannot:
`Compared.broken`, what each injected mistake must show, is a comparison that is not `ok`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch

from tests.support.hf_glm5 import forced_selections, selection_leads
from tests.support.rounding import SIGMAS, logit_spread, logit_tolerance, route_leads
from tests.support.routing import hf_routing, hf_selections

__all__ = ["Compared", "compare", "engine_logits", "own_rounding"]


@dataclasses.dataclass(frozen=True)
class Compared:
    """One comparison: the largest |Δlogit| of any token and of a compared one; the tightest and
    loosest tolerance of a compared token; compared tokens over theirs, and the largest share of
    its tolerance a compared token reached (`worst`), of `compared` of `tokens`; (token, layer)
    router decisions and (query, layer) index choices apart; each sequence's first choice apart as
    Megatron's lead there, in standard deviations of the rounding (`leads`), and at each later
    choice apart made from inputs within what rounding makes (`later_leads`), how many of those
    are not near-ties (`far`: `SIGMAS` or more); and the mean |logit| of Megatron's."""

    max_diff: float
    compared_max: float
    tolerance: tuple[float, float]
    over: int
    worst: float
    compared: int
    tokens: int
    routed_apart: int
    indexed_apart: int
    leads: tuple[float, ...]
    later_leads: tuple[float, ...]
    mean_logit: float

    @property
    def far(self) -> int:
        return sum(lead >= SIGMAS for lead in (*self.leads, *self.later_leads))

    @property
    def ok(self) -> bool:
        return self.over == 0 and self.far == 0

    @property
    def broken(self) -> bool:
        """What each injected mistake must show: a compared token over its tolerance or a choice
        apart that rounding does not reach, both bounds at `SIGMAS` (a right mapping's worst, in
        tests/integration/test_families.py's output, sits far inside both)."""
        return not self.ok

    def __str__(self) -> str:
        low, high = self.tolerance
        return (
            f"max |Δlogit| {self.max_diff:.4f}, compared max {self.compared_max:.4f} (tolerance {low:.2f}-{high:.2f}), "
            f"over {self.over} (worst {self.worst:.2f} of its tolerance), compared {self.compared}/{self.tokens}, routed apart {self.routed_apart}, "
            f"indexed apart {self.indexed_apart}, first choices apart at {[round(x, 2) for x in self.leads]} sigma, "
            f"later ones judged {len(self.later_leads)} (largest {max(self.later_leads, default=0):.2f}) "
            f"({self.far} not near-ties), mean |logit| {self.mean_logit:.3f}"
        )


def _apart(megatron: dict, hf: dict, tokens: torch.Size, topk: int) -> dict[tuple[int, int], torch.Tensor]:
    """{(layer, 0 for the indexer / 1 for the router): [batch, seq] whether that decision differs};
    with `topk`, `megatron` and `hf` are index records, else routing records."""
    only_megatron = set(megatron) - set(hf)  # its MTP layers', past every layer transformers has
    if set(hf) - set(megatron) or (hf and only_megatron and min(only_megatron) < max(hf)):
        raise ValueError(f"Megatron chose in layers {sorted(megatron)}, transformers in {sorted(hf)}")
    out = {}
    for layer in sorted(hf):
        if topk:
            theirs = megatron[layer]["keys"].long().sort(-1).values
            differ = (hf[layer]["keys"].sort(-1).values != theirs).any(-1)
            differ[:, :topk] = False  # before, both take every key, and the masked ones they add are free
        else:
            differ = (megatron[layer]["map"] != hf[layer]["map"]).any(dim=-1)
        out[(layer, 0 if topk else 1)] = differ.reshape(tokens)
    return out


def _leads(
    apart: dict[tuple[int, int], torch.Tensor], routing: tuple[dict, dict], selections: tuple[dict, dict]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Megatron's lead, in standard deviations of the rounding between the two sides' scores from
    the inputs each was given, at each sequence's first decision apart (its first token apart,
    there the lowest layer, an indexer before its layer's router), infinite where those inputs had
    drifted past what rounding does, as nothing before it in its sequence chose apart; and at each
    later decision apart whose inputs had not drifted that far (what a choice apart before it
    changed is in their drift)."""
    if not apart:
        return (), ()
    order = sorted(apart)
    by_decision = {}
    for layer, kind in order:
        if kind == 0:
            by_decision[(layer, kind)] = selection_leads(selections[0][layer], selections[1][layer], layer)
        else:
            by_decision[(layer, kind)] = route_leads(routing[0][layer], routing[1][layer]["x"], layer)
    stacked = torch.stack([apart[key] for key in order])  # [decisions, batch, seq]
    first, later = [], []
    for b in range(stacked.shape[1]):
        tokens = stacked[:, b].any(dim=0).nonzero()
        if not len(tokens):
            continue
        t0 = int(tokens[0])
        d0 = int(stacked[:, b, t0].nonzero()[0])
        first.append(round(float(by_decision[order[d0]][b, t0].nan_to_num(nan=torch.inf)), 3))
        for d, t in stacked[:, b].nonzero().tolist():
            lead = float(by_decision[order[d]][b, t])
            if (d, t) != (d0, t0) and lead == lead:  # not NaN: inputs within what rounding makes
                later.append(round(lead, 3))
    return tuple(first), tuple(later)


def compare(
    megatron: torch.Tensor,
    hf: torch.Tensor,
    spread: torch.Tensor,
    layers: int,
    routing: tuple[dict, dict],
    selections: tuple[dict, dict] = ({}, {}),
    topk: int = 0,
    own: torch.Tensor | None = None,
) -> Compared:
    """Megatron's logits against transformers' ([batch, seq, vocab]) of a model of `layers`
    decoder layers, transformers' logit `spread` [batch, seq] (`rounding.logit_spread`);
    `routing` (Megatron's, HF's records) by layer; `selections` (Megatron's and HF's index
    records) of a DSA model with index top-k `topk` (Megatron's layers HF has not, the MTP
    layers', are not compared); `own` [batch, seq] transformers' own rounding (`own_rounding`),
    which the tolerance adds to what the rounding model bounds Megatron's by."""
    errors = (hf - megatron).abs().amax(dim=-1)  # [batch, seq]
    routed = _apart(*routing, errors.shape, 0)
    indexed = _apart(*selections, errors.shape, topk) if selections[1] else {}
    apart = {**routed, **indexed}
    compared = torch.ones_like(errors, dtype=torch.bool)
    if apart:
        compared = ~torch.stack(list(apart.values())).any(dim=0).int().cummax(dim=-1).values.bool()
    tolerance = logit_tolerance(megatron, spread, layers) + (0 if own is None else own)
    first, later = _leads(apart, routing, selections)
    return Compared(
        max_diff=float(errors.max()),
        compared_max=float(errors[compared].max()) if compared.any() else 0.0,
        tolerance=(float(tolerance[compared].min()), float(tolerance[compared].max())) if compared.any() else (0, 0),
        over=int((errors > tolerance)[compared].sum()),
        worst=float((errors / tolerance)[compared].max()) if compared.any() else 0.0,
        compared=int(compared.sum()),
        tokens=errors.numel(),
        routed_apart=sum(int(d.sum()) for d in routed.values()),
        indexed_apart=sum(int(d.sum()) for d in indexed.values()),
        leads=first,
        later_leads=later,
        mean_logit=float(megatron.abs().mean()),
    )


def engine_logits(
    model: Any, tokens: torch.Tensor, forced: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """transformers' `model`'s logits of `tokens`, their spread (`rounding.logit_spread`), its
    routing and its indexers' records; with `forced` (Megatron's selections), each DSA layer
    attends to Megatron's keys instead."""
    device = next(model.parameters()).device
    with contextlib.ExitStack() as stack, torch.no_grad():
        routing = stack.enter_context(hf_routing(model, batch=tokens.shape[0]))
        spreads = stack.enter_context(logit_spread(model))
        keys = stack.enter_context(forced_selections(model, forced) if forced else hf_selections(model))
        logits = model(input_ids=tokens.to(device)).logits.float().cpu()

    def cpu(records: dict) -> dict:
        return {layer: {name: t.cpu() for name, t in record.items()} for layer, record in records.items()}

    return logits, spreads[0], cpu(routing), cpu(keys)


def own_rounding(
    model: Any, tokens: torch.Tensor, served: tuple[torch.Tensor, dict, dict], topk: int = 0
) -> torch.Tensor:
    """[batch, seq]: how far transformers' bf16 `model` itself is from the function it computes,
    on `tokens`: each token's worst |Δlogit| against an fp32 copy of it (2^16 times finer: the
    exact function, for this), from `served` (its logits, routing and index records of `tokens`),
    where the copy made every choice it made (elsewhere 0: that is no rounding of one function).
    Megatron and transformers are then apart by at most this and Megatron's own rounding, which
    the rounding model bounds; this measures what the model cannot count, how a trained model
    amplifies its roundings, on the CPU's own kernels."""
    logits, routing, keys = served
    exact, _, exact_routing, exact_keys = engine_logits(copy.deepcopy(model).float(), tokens)
    errors = (logits.float().cpu() - exact).abs().amax(-1)
    apart = {
        **_apart(exact_routing, routing, errors.shape, 0),
        **(_apart(exact_keys, keys, errors.shape, topk) if keys else {}),
    }
    if apart:
        errors = errors.masked_fill(torch.stack(list(apart.values())).any(0).int().cummax(-1).values.bool(), 0.0)
    return errors
