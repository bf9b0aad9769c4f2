"""The rounding model of the whole-path tests (tests/support/rounding.py), against what it models.

Two sides each round every factor of an indexer's scores (q, k and the head weights) the number of
times `rounding.INDEXER` counts, each rounding uniform within U of the value, independently: the
spread of the two sides' score differences, over many such pairs, must be within what
`index_variance` says (its head-weight term is a bound, so it may say more, but not by much, or
the near-tie test would pass anything). Then the margin `leads` measures, and the -1 slots of a
query with fewer keys than the top-k, and a drift past what rounding makes.
"""

from __future__ import annotations

import math

import torch

from tests.support.hf_glm5 import selection_leads
from tests.support.megatron_dsa import _rounding_terms
from tests.support.rounding import INDEXER, U, drift_bound, index_variance, leads

SEQ, HEADS, DIM = 8, 4, 32


PAIRS = 2000


def _scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[pairs, batch, seq, keys] Megatron's index score, sum_h w_h relu(q_h . k_t), of each pair's factors."""
    return torch.einsum("psbht,psbh->pbst", torch.einsum("psbhd,ptbd->psbht", q, k).relu(), weights)


def _rounded(x: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`PAIRS` copies of `x`, each element rounded `count` times, each uniform within U of it."""
    noise = U * (2 * torch.rand(count, PAIRS, *x.shape, generator=generator, dtype=x.dtype) - 1)
    return x * (1 + noise).prod(0)


def test_the_index_variance_holds_the_spread_of_independent_roundings() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, 1, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(SEQ, 1, DIM, generator=g, dtype=torch.float64)
    weights = torch.randn(SEQ, 1, HEADS, generator=g, dtype=torch.float64)
    terms = _rounding_terms(q, weights, k)
    predicted = index_variance(terms["spread"], terms["magnitude"], torch.zeros(1, SEQ)).double()

    def side() -> torch.Tensor:
        return _scores(_rounded(q, INDEXER.query, g), _rounded(weights, INDEXER.weight, g), _rounded(k, INDEXER.key, g))

    seen = (side() - side()).var(0)
    live = predicted > 0
    ratio = (seen[live] / predicted[live]).sqrt()  # empirical over predicted standard deviation
    # `PAIRS` (2,000) estimate a standard deviation to within about 1.6% (1/sqrt(2 x 2000)): 10% is 6 of them.
    assert ratio.max() < 1.1, f"the model says less than the roundings do: {ratio.max():.2f}"
    assert ratio.median() > 0.3, f"the model says several times what the roundings do: {ratio.median():.2f}"


def test_leads_is_the_margin_over_the_roundings_standard_deviation() -> None:
    scores = torch.tensor([[3.0, 2.0, 1.0, float("-inf")]])
    chosen = torch.tensor([[True, True, False, False]])
    variance = torch.tensor([[1.0, 0.25, 0.75, 9.0]])
    assert leads(scores, variance, chosen).tolist() == [1.0]  # (2 - 1) / sqrt(0.25 + 0.75)
    everything = torch.tensor([[True, True, True, False]])  # the rest masked: nothing in reach
    assert leads(scores, variance, everything).tolist() == [float("inf")]
    drifted = torch.tensor([drift_bound(0) * 1.01])
    assert leads(scores, variance, chosen, drifted, layer=0).isnan().all(), "past rounding: no rounding question"
    assert not leads(scores, variance, chosen, torch.tensor([drift_bound(0)]), layer=0).isnan().any()


def test_an_indexer_record_with_fewer_keys_than_its_top_k_marks_them_minus_one() -> None:
    """megatron-core 0.19 fills the top-k of an early query, which sees fewer keys, with -1."""
    scores = torch.tensor([[[1.0, float("-inf"), float("-inf")], [2.0, 1.5, float("-inf")], [3.0, 1.0, 2.9]]])
    keys = torch.tensor([[[0, -1], [0, 1], [0, 2]]])
    record = {"scores": scores, "keys": keys, "spread": torch.ones_like(scores), "magnitude": torch.zeros_like(scores)}
    found = selection_leads(record)
    one = (INDEXER.query + INDEXER.key) * 2 * U**2 / 3  # each score's variance at a spread of 1
    assert abs(float(found[0, 2]) - 1.9 / math.sqrt(2 * one)) < 1e-3 * float(found[0, 2])  # 2.9 over 1.0
    assert found[0, :2].isinf().all(), "no key left out"
