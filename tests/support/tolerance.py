"""How the whole-path tests judge transformers' logits against Megatron's (tests/integration/
test_families.py, tests/gpu/test_families_gpu.py); see `compare`.

Megatron and transformers compute the same function in bf16 with other kernels (fused QKV, the
order of reductions, where each rounds), so their logits differ by rounding that grows through
the layers. Discrete choices inside the model amplify it: an MoE router near a tie can pick another
expert in one than in the other, and a DSA indexer another key; that token's logits then move by
far more, and through attention those of the later tokens of its sequence. So:

- each side records every router's chosen experts and every indexer's chosen keys (forward hooks:
  tests/support/routing.py, megatron_dsa.recorded_selections);
- a sequence is compared only up to its first token routed (or indexed) differently in any layer;
- at most `ROUTING_FLIPS` (token, layer) router decisions (twice that where DSA indexers choose
  freely too: an index near-tie moves the later tokens of its sequence, and so their routers) and
  `INDEX_FLIPS` (query, layer) index choices may differ, and the first choice of a sequence that differs, the only one both sides
  made on the same inputs, must be a near-tie where it is an index choice (Megatron's k-th index
  score leads the next by less than `FIRST_TIE` of the query's largest |score|);
- each compared token's worst |Δlogit| must be within `token_tolerance`: 0.15, or 8 units in the
  last place of its largest bf16 logit where that is more (a logit in [4, 8) is held to 1/32, so
  0.15 would be under 5 of them). A dense model routes nothing: every token is compared.

A wrong mapping moves the compared tokens, or routes or indexes many tokens apart: `Compared.broken`
asks for more than 2 x `ROUTING_FLIPS` compared tokens over (where the right mapping has none), or
more than 4 x `ROUTING_FLIPS` router or 2 x `INDEX_FLIPS` index decisions apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tests.support.hf_glm5 import NEAR_TIE
from tests.support.routing import hf_routing, hf_selections

__all__ = [
    "INDEX_FLIPS",
    "ROUTING_FLIPS",
    "TOLERANCE",
    "ULPS",
    "Compared",
    "compare",
    "engine_logits",
    "token_tolerance",
]

TOLERANCE, ULPS = 0.15, 8
ROUTING_FLIPS = 3  # (token, layer) router decisions of BATCH x SEQ = 64 a layer, in one comparison
INDEX_FLIPS = 12  # (query, layer) index choices, of 96 (the queries with more keys than the top-k)
# A sequence's first index choice apart, free-running, is a near-tie below this lead (of the query's
# largest |score|): `NEAR_TIE` (1%) holds one indexer on the same inputs; a later layer's inputs
# went through the earlier layers' rounding too (measured: 1.3% at layer 1).
FIRST_TIE = 3 * NEAR_TIE


def token_tolerance(megatron: torch.Tensor, floor: float = TOLERANCE) -> torch.Tensor:
    """[batch, seq]: each token's tolerance (see the module docstring)."""
    ulp = torch.exp2(torch.floor(torch.log2(megatron.abs().amax(dim=-1))) - 7)  # bf16 keeps 8 bits
    return torch.clamp(ULPS * ulp, min=floor)


@dataclasses.dataclass(frozen=True)
class Compared:
    """One comparison: the largest |Δlogit| of any token and of a compared one; the tightest and
    loosest tolerance of a compared token; compared tokens over theirs, of `compared` of `tokens`;
    (token, layer) router decisions apart; (query, layer) index choices apart, and how many
    sequences' first choice apart was an index choice not near a tie; and the mean |logit| of
    Megatron's."""

    max_diff: float
    compared_max: float
    tolerance: tuple[float, float]
    over: int
    compared: int
    tokens: int
    routed_apart: int
    indexed_apart: int
    indexed_far: int
    mean_logit: float
    routing_flips: int = ROUTING_FLIPS  # router decisions allowed apart

    @property
    def ok(self) -> bool:
        return (
            self.over == 0
            and self.routed_apart <= self.routing_flips
            and self.indexed_apart <= INDEX_FLIPS
            and self.indexed_far == 0
        )

    @property
    def broken(self) -> bool:
        """Far outside what rounding does: what each injected mistake must show."""
        return (
            self.over > 2 * ROUTING_FLIPS
            or self.routed_apart > 4 * ROUTING_FLIPS
            or self.indexed_apart > 2 * INDEX_FLIPS
        )

    def __str__(self) -> str:
        low, high = self.tolerance
        return (
            f"max |Δlogit| {self.max_diff:.4f}, compared max {self.compared_max:.4f} (tolerance {low:.2f}-{high:.2f}), "
            f"over {self.over}, compared {self.compared}/{self.tokens}, routed apart {self.routed_apart}, "
            f"indexed apart {self.indexed_apart} ({self.indexed_far} not near-ties), mean |logit| {self.mean_logit:.3f}"
        )


def _apart(megatron: dict, hf: dict, tokens: torch.Size, topk: int) -> dict[tuple[int, int], torch.Tensor]:
    """{(layer, 0 for the indexer / 1 for the router): [batch, seq] whether that decision differs};
    with `topk`, `megatron` and `hf` are index selections, else routing maps."""
    if sorted(megatron) != sorted(hf) and not topk:
        raise ValueError(f"Megatron routed in layers {sorted(megatron)}, transformers in {sorted(hf)}")
    out = {}
    for layer in sorted(hf):
        if topk:
            theirs = megatron[layer]["keys"].long().sort(-1).values
            differ = (hf[layer].sort(-1).values != theirs).any(-1)
            differ[:, :topk] = False  # before, both take every key, and the masked ones they add are free
        else:
            differ = (megatron[layer] != hf[layer]).any(dim=-1)
        out[(layer, 0 if topk else 1)] = differ.reshape(tokens)
    return out


def _first_far(apart: dict[tuple[int, int], torch.Tensor], megatron_keys: dict, topk: int) -> int:
    """Of each sequence's first decision apart (its first token apart, there the lowest layer, an
    indexer before its layer's router): the only one made on the same inputs on both sides. How
    many of those are index choices that were not near-ties."""
    if not apart:
        return 0
    order = sorted(apart)
    stacked = torch.stack([apart[key] for key in order])  # [decisions, batch, seq]
    far = 0
    for b in range(stacked.shape[1]):
        tokens = stacked[:, b].any(dim=0).nonzero()
        if not len(tokens):
            continue
        t = int(tokens[0])
        layer, kind = order[int(stacked[:, b, t].nonzero()[0])]
        if kind == 0:
            scores = megatron_keys[layer]["scores"][b, t]
            ranked = scores.sort(descending=True).values
            far += bool((ranked[topk - 1] - ranked[topk]) / scores.nan_to_num(neginf=0.0).abs().max() >= FIRST_TIE)
    return far


def compare(
    megatron: torch.Tensor,
    hf: torch.Tensor,
    routing: tuple[dict, dict],
    selections: tuple[dict, dict] = ({}, {}),
    topk: int = 0,
    floor: float = TOLERANCE,
) -> Compared:
    """Megatron's logits against transformers' ([batch, seq, vocab]); `routing` (Megatron's, HF's)
    by layer; `selections` (Megatron's {layer: {scores, keys}}, HF's {layer: keys}) of a DSA model
    with index top-k `topk` (Megatron's layers HF has not, the MTP layers', are not compared);
    `floor` the least tolerance a token gets (`TOLERANCE` on the CPU)."""
    errors = (hf - megatron).abs().amax(dim=-1)  # [batch, seq]
    routed = _apart(*routing, errors.shape, 0)
    indexed = _apart(*selections, errors.shape, topk) if selections[1] else {}
    apart = {**routed, **indexed}
    compared = torch.ones_like(errors, dtype=torch.bool)
    if apart:
        compared = ~torch.stack(list(apart.values())).any(dim=0).int().cummax(dim=-1).values.bool()
    tolerance = token_tolerance(megatron, floor)
    return Compared(
        max_diff=float(errors.max()),
        compared_max=float(errors[compared].max()) if compared.any() else 0.0,
        tolerance=(float(tolerance[compared].min()), float(tolerance[compared].max())) if compared.any() else (0, 0),
        over=int((errors > tolerance)[compared].sum()),
        compared=int(compared.sum()),
        tokens=errors.numel(),
        routed_apart=sum(int(d.sum()) for d in routed.values()),
        indexed_apart=sum(int(d.sum()) for d in indexed.values()),
        indexed_far=_first_far(apart, selections[0], topk),
        mean_logit=float(megatron.abs().mean()),
        routing_flips=ROUTING_FLIPS * (2 if topk and selections[1] else 1),
    )


def engine_logits(model: Any, tokens: torch.Tensor, forced: dict | None = None) -> tuple[torch.Tensor, dict, dict]:
    """transformers' `model`'s logits of `tokens`, its routing and its indexers' keys; with
    `forced` (Megatron's selections), each DSA layer attends to Megatron's keys instead."""
    import contextlib

    from tests.support.hf_glm5 import forced_selections

    device = next(model.parameters()).device
    with contextlib.ExitStack() as stack, torch.no_grad():
        routing = stack.enter_context(hf_routing(model, batch=tokens.shape[0]))
        keys = stack.enter_context(forced_selections(model, forced) if forced else hf_selections(model))
        logits = model(input_ids=tokens.to(device)).logits.float().cpu()
    return logits, {k: v.cpu() for k, v in routing.items()}, {k: v.cpu() for k, v in keys.items()}
