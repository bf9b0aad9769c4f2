"""How far two bf16 implementations of one model can be apart by rounding alone: the model by which
the whole-path tests judge a DSA indexer's keys, a router's experts and the logits
(tests/support/tolerance.py, `hf_glm5.agreement`). Nothing here is a figure measured on one CPU.

Megatron and transformers make the same choice from scores each computes in bf16 with its own
kernels. They choose apart only where the two sides' rounding moves the k-th score below the
next, so a choice apart is a rounding effect only if Megatron's margin there (its k-th score over
the next) is within what rounding can move. The model:

- bf16 keeps 8 significant bits: one rounding moves a value by at most `U` = 2^-8 of itself, and,
  over many values, uniformly within that, a variance of U²/3 of its square.
- A score is a sum of products of bf16 factors: an indexer's `sum_h w_h relu(q_h . k_t)`, a
  router's `x . W_e`. Each factor carries the roundings of its own path on each side (`Roundings`,
  `route_variance`: counted from the two frameworks' code), and the difference its inputs already
  had, which is measured: each token's relative rms difference between the two sides' inputs of
  that layer (`drift`), zero where both were handed the same tensors.
- Errors of different elements are independent, so a score's error has the variance
  `sum over its terms of term² × (the variances of its factors)`; the two sides round
  independently, so their own roundings count twice, the drift (already a difference) once.
- The margin moves by the difference of the two scores' errors. A choice apart is a *near-tie*
  if Megatron's margin is under `SIGMAS` of that difference's standard deviation: a sum of dozens
  of independent roundings is near normal, and passes 6 sigma with a probability of about 2e-9.
- A logit `h . W_v` (h the final norm's output) is held the same way (`logit_tolerance`): h drifts
  as the inputs of a layer past the last do, and each side rounds the logit itself once more.
- The drift itself is held to what rounding can make: each decoder layer before, and the
  embedding, rounds the residual stream `LAYER` times on each side (counted below), so layer l's
  inputs drift by at most `SIGMAS` standard deviations of (l + 1) x `LAYER` roundings on each side
  (`drift_bound`: the l layers before, and the part of layer l before its choice). A choice made
  from inputs that drifted further is no rounding effect: a wrong mapping upstream, which the
  tests must not mistake for a near-tie.

A wrong mapping moves scores by far more than rounding: the tests show, each with the mistake the
check exists for, that it then chooses apart beyond `SIGMAS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "FP32_U",
    "INDEXER",
    "LAYER",
    "SIGMAS",
    "Roundings",
    "U",
    "drift",
    "drift_bound",
    "index_variance",
    "leads",
    "logit_spread",
    "logit_tolerance",
    "route_leads",
    "route_variance",
    "spread_of",
]

U = 2.0**-8  # bf16's unit roundoff: 8 significant bits
SIGMAS = 6.0
# One decoder layer's roundings of what reaches the residual stream, on one side: attention's
# input norm, its q, k and v projections (MLA's down and up projections and their norms), RoPE's
# three, the scores, the softmax, the weighted sum, the output projection and the residual add
# (15); the MLP's norm, its gate and up projections, the activation, the product, the down
# projection, a router's weighting and combination, and the residual add (9).
LAYER = 24


@dataclasses.dataclass(frozen=True)
class Roundings:
    """bf16 roundings, on one side, between a layer's inputs and each factor of its scores."""

    query: int  # an indexer's q: the `wq_b` linear, RoPE's two products and their sum, the Hadamard rotation
    key: int  # its k: the `wk` linear, its LayerNorm, RoPE's three, the Hadamard rotation
    weight: int  # its head weights: the linear, then Megatron's two scalings in bf16

    def variances(self, drift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each factor's relative variance of the two sides' difference: both sides' roundings,
        and the inputs' `drift` once."""
        per = 2 * U**2 / 3
        return tuple(count * per + drift.square() for count in (self.query, self.key, self.weight))  # type: ignore[return-value]


INDEXER = Roundings(query=5, key=6, weight=3)
FP32_U = 2.0**-24  # fp32's unit roundoff: 24 significant bits


def drift_bound(layer: int) -> float:
    """The most relative rms drift rounding gives the inputs of decoder layer `layer` (0-based):
    `SIGMAS` standard deviations of both sides' (layer + 1) x `LAYER` roundings."""
    return SIGMAS * U * math.sqrt(2 * (layer + 1) * LAYER / 3)


def drift(megatron: torch.Tensor, hf: torch.Tensor) -> torch.Tensor:
    """[batch, seq]: each token's relative rms difference of the two sides' inputs ([batch, seq,
    hidden]), made cumulative along the sequence (a query reads the keys up to its own)."""
    diff = (hf.float() - megatron.float()).norm(dim=-1) / megatron.float().norm(dim=-1).clamp_min(1e-30)
    return diff.cummax(dim=-1).values


def index_variance(spread: torch.Tensor, magnitude: torch.Tensor, token_drift: torch.Tensor) -> torch.Tensor:
    """[batch, seq, keys]: the variance of the difference of the two sides' index scores, from
    `spread` (sum_h w_h² sum_d q_hd² k_td²), `magnitude` (sum_h |w_h| |q_h . k_t|) and the
    query token's `drift` [batch, seq]. A head weight's error scales its whole head's term, so it
    enters through `magnitude²`, the bound for errors of one sign."""
    v_query, v_key, v_weight = INDEXER.variances(token_drift.unsqueeze(-1))
    return spread * (v_query + v_key) + magnitude.square() * v_weight


def route_variance(spread: torch.Tensor, value: torch.Tensor, token_drift: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., experts]: the variance of the difference of the two sides' router scores, from each
    score's `spread` (sum_d x_d² W_ed², times the score function's slope squared), its `value`
    (the logit squared, times the same), each token's `drift` [...] and the `hidden` size. Both
    sides record the router's input after its norm, so the drift holds every bf16 rounding of x;
    then Megatron and transformers' DeepSeek-V3-style routers take the logits in fp32 (`hidden`
    terms, on each side), and transformers' Qwen3-MoE and Mixtral routers round them to bf16
    once."""
    accumulation = 2 * hidden * FP32_U**2 / 3
    return spread * (token_drift.unsqueeze(-1).square() + accumulation) + value * U**2 / 3


def leads(
    scores: torch.Tensor,
    variance: torch.Tensor,
    chosen: torch.Tensor,
    token_drift: torch.Tensor | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """[...]: Megatron's margin between its lowest chosen score and its highest unchosen one, in
    standard deviations of the rounding between those two (`variance` of each score's difference,
    `chosen` a bool mask of Megatron's choice, both shaped as `scores` [..., candidates]). Masked
    candidates (-inf) are never in reach: a choice with nothing unchosen has an infinite lead. A
    choice made from inputs that drifted past `drift_bound(layer)` (`token_drift` [...]) is no
    rounding question: its lead is NaN."""
    finite = scores.isfinite()
    low = scores.masked_fill(~chosen, float("inf")).min(-1)
    high = scores.masked_fill(chosen | ~finite, float("-inf")).max(-1)
    var_low = variance.gather(-1, low.indices.unsqueeze(-1)).squeeze(-1)
    var_high = variance.gather(-1, high.indices.unsqueeze(-1)).squeeze(-1)
    margin = low.values - high.values
    lead = torch.where(high.values.isfinite(), margin / (var_low + var_high).sqrt().clamp_min(1e-30), torch.inf)
    if token_drift is not None:
        lead = lead.masked_fill(token_drift > drift_bound(layer), float("nan"))
    return lead


def route_leads(megatron: dict[str, torch.Tensor], hf_input: torch.Tensor | None, layer: int) -> torch.Tensor:
    """[batch, seq] each token's lead (`leads`) in decoder layer `layer`'s router's record
    (`routing.megatron_routing`), against transformers' router input `hf_input` [batch, seq,
    hidden] (None: the same input).
    Group-limited routing chooses twice: its groups by their scores (the sum of each group's
    top `k / groups chosen` scores), then its experts within those; the lead is the smaller."""
    scores, chosen = megatron["scores"], megatron["map"]
    token_drift = torch.zeros(scores.shape[:-1]) if hf_input is None else drift(megatron["x"], hf_input)
    variance = route_variance(megatron["spread"], megatron["value"], token_drift, megatron["x"].shape[-1])
    groups, picked = (int(n) for n in megatron["groups"])
    if groups == 1:
        return leads(scores, variance, chosen, token_drift, layer)
    per = int(chosen[0, 0].sum()) // picked  # experts a chosen group gives
    grouped = scores.unflatten(-1, (groups, -1))
    top = grouped.topk(per, dim=-1)
    group_scores = top.values.sum(-1)
    group_variance = variance.unflatten(-1, (groups, -1)).gather(-1, top.indices).sum(-1)
    in_chosen = chosen.unflatten(-1, (groups, -1)).any(-1)
    experts = scores.masked_fill(~in_chosen.repeat_interleave(scores.shape[-1] // groups, dim=-1), float("-inf"))
    return torch.minimum(
        leads(group_scores, group_variance, in_chosen, token_drift, layer),
        leads(experts, variance, chosen, token_drift, layer),
    )


@contextlib.contextmanager
def logit_spread(model: Any) -> Iterator[list[torch.Tensor]]:
    """While on, each forward of transformers' `model` appends its tokens' logit spread [batch,
    seq]: the largest over the vocabulary of sqrt(sum_d h_d² W_vd²), h its final norm's output and
    W its `lm_head`'s weight (`logit_tolerance`)."""
    spreads: list[torch.Tensor] = []

    def keep(_module: Any, _args: Any, h: torch.Tensor) -> None:
        spreads.append(spread_of(h, model.lm_head.weight))

    handle = model.model.norm.register_forward_hook(keep)
    try:
        yield spreads
    finally:
        handle.remove()


def spread_of(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[..., tokens]: max_v sqrt(sum_d h_d² W_vd²) of the final hidden states `h` [..., hidden]
    and an output layer's `weight` [vocab, hidden]."""
    return (h.detach().float().square() @ weight.detach().float().square().T).amax(-1).sqrt().cpu()


def logit_tolerance(logits: torch.Tensor, spread: torch.Tensor, layers: int) -> torch.Tensor:
    """[batch, seq]: how far rounding can move each token's logits apart, from Megatron's `logits`
    [batch, seq, vocab], the tokens' `spread` and the model's decoder `layers`. The final hidden
    state drifts as the inputs of a layer `layers` would (`drift_bound`), which moves a logit by
    that relative drift times sqrt(sum_d h_d² W_vd²), at `SIGMAS`; the logit's own rounding, once
    on each side, adds 2 U of its largest |value|."""
    return drift_bound(layers) * spread + 2 * U * logits.abs().amax(-1)
