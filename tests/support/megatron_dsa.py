"""What Megatron-core's DSA (DeepSeek Sparse Attention) layers chose, recorded for the GLM-5 tests.

The layers are built by the package's specs (`orchestrator.adapters.megatron.specs`, which says
what stands in for Transformer Engine and `fast_hadamard_transform`); its seams are re-exported
here for the tests that import them from this module. `recorded_selections` keeps, per DSA layer,
the index scores, the keys chosen, their inputs and each score's rounding terms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from orchestrator.adapters.megatron.convert.mtp import numbered_layers
from orchestrator.adapters.megatron.specs import (
    dsa_attention_spec,
    dsa_block_spec,
    duplicated_linear,
    enable_dsa_without_extensions,
    presize_indexer_loss_tracker,
    walsh_hadamard,
)

__all__ = [
    "dsa_attention_spec",
    "dsa_block_spec",
    "duplicated_linear",
    "enable_dsa_without_extensions",
    "presize_indexer_loss_tracker",
    "recorded_selections",
    "walsh_hadamard",
]


def _factors_seen(indexer: Any, into: dict[str, torch.Tensor]) -> Any:
    """Has `indexer` keep its q [seq, batch, heads, dim], head weights [seq, batch, heads] and k
    [seq, batch, dim] of each forward in `into`, where its version hands them over: 0.19's
    `forward_before_topk` returns them, 0.16.1's `_compute_index_scores` method takes them."""
    if hasattr(indexer, "forward_before_topk"):

        def before_topk(*args: Any, _real: Any = indexer.forward_before_topk, **kw: Any) -> Any:
            q, k, weights = _real(*args, **kw)
            into.update(q=q, weights=weights, k=k)
            return q, k, weights

        indexer.forward_before_topk = before_topk
        return "forward_before_topk"

    def compute(q: Any, weights: Any, k: Any, _real: Any = indexer._compute_index_scores) -> Any:
        into.update(q=q, weights=weights, k=k)
        return _real(q, weights, k)

    indexer._compute_index_scores = compute
    return "_compute_index_scores"


def _rounding_terms(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """[batch, seq, keys] each index score's `spread` (sum_h w_h² sum_d q_hd² k_td²) and
    `magnitude` (sum_h |w_h| |q_h . k_t|, a bound with or without the score's ReLU): what
    `tests/support/rounding.index_variance` reads."""
    q, weights, k = q.detach().float(), weights.detach().float(), k.detach().float()
    spread = torch.einsum("sbhd,tbd,sbh->bst", q.square(), k.square(), weights.square())
    magnitude = torch.einsum("sbht,sbh->bst", torch.einsum("sbhd,tbd->sbht", q, k).abs(), weights.abs())
    return {"spread": spread, "magnitude": magnitude}


@contextlib.contextmanager
def scored(indexer: Any) -> Iterator[dict[str, torch.Tensor]]:
    """While on, each `forward_with_scores` of `indexer` (a `DSAIndexer`) records what it
    computed: its index scores [batch, seq, keys] (`scores`), the keys it selected [batch, seq,
    topk] (`keys`), its inputs x and q latent [batch, seq, dim] (`x`, `qr`), and each score's
    rounding terms (`spread`, `magnitude`)."""
    record: dict[str, torch.Tensor] = {}
    factors: dict[str, torch.Tensor] = {}
    seam = _factors_seen(indexer, factors)

    def forward(x: Any, qr: Any, *args: Any, _real: Any = indexer.forward_with_scores, **kw: Any) -> Any:
        scores, keys = _real(x, qr, *args, **kw)
        record.clear()
        record.update(scores=scores.detach().float().clone(), keys=keys.detach().clone())
        record.update(x=x.detach().transpose(0, 1).clone(), qr=qr.detach().transpose(0, 1).clone())
        record.update(_rounding_terms(factors["q"], factors["weights"], factors["k"]))
        return scores, keys

    indexer.forward_with_scores = forward  # DSAttention calls it directly, past any module hook
    try:
        yield record
    finally:
        del indexer.forward_with_scores, indexer.__dict__[seam]  # the class's again


@contextlib.contextmanager
def recorded_selections(gpt: Any) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """While on, what each DSA layer of `gpt` (a `GPTModel`, this stage's) computed in a forward
    (`scored`), by global layer (the decoder's, then each MTP layer as `N + j`)."""
    with contextlib.ExitStack() as stack:
        records = {
            index: stack.enter_context(scored(layer.self_attention.core_attention.indexer))
            for index, layer in numbered_layers(gpt)
            if getattr(layer.self_attention.core_attention, "indexer", None) is not None
        }
        yield records
