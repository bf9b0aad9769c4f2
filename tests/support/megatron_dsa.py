"""Megatron-core's DSA (DeepSeek Sparse Attention) layer on a host without its CUDA extensions.

megatron-core 0.16.1 builds DSA only through Transformer Engine: `get_dsa_module_spec_for_backend`
asks its backend for `linear()` (a replicated `TELinear`, `parallel_mode="duplicated"`), which the
local `LocalSpecProvider` lacks, and its `rotate_activation` calls `fast_hadamard_transform`, a CUDA
extension. Neither is installed here or on the GPU machine. Three narrow seams stand in, and nothing
else is replaced: the attention is Megatron's `MLASelfAttention` around its `DSAttention`, the
indexer its `DSAIndexer`, the sparse attention its `unfused_dsa_fn`, with their own math.

1. `walsh_hadamard` for `dsa.hadamard_transform`: the same transform as `fast_hadamard_transform`'s
   (x times the Sylvester Hadamard matrix of the last dim, times `scale`, computed in fp32 and
   returned in the input's dtype), in plain torch ops, so autograd goes through it.
2. `duplicated_linear()` for the indexer's `linear_wq_b`, `linear_wk` and `linear_weights_proj`:
   Megatron's own local replicated `Linear` (`megatron.core.post_training.modelopt.layers`), taking
   the `parallel_mode="duplicated"` that `DSAIndexer` passes to a `TELinear`.
3. `presize_indexer_loss_tracker`: the indexer-loss logger sizes its per-layer tracker by
   `num_layers`, so an MTP layer's DSA (layer `num_layers + 1`) indexes past its end (IndexError in
   0.16.1 whenever `dsa_indexer_loss_coeff > 0` and `mtp_num_layers` are set, on any device). The
   tracker is made once with a slot per MTP layer too; the loss itself is untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "dsa_attention_spec",
    "dsa_block_spec",
    "duplicated_linear",
    "enable_dsa_without_extensions",
    "presize_indexer_loss_tracker",
    "recorded_selections",
    "walsh_hadamard",
]


def walsh_hadamard(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`x @ H.T * scale` for the Sylvester Hadamard matrix `H` of `x`'s last dim (a power of 2), as
    `fast_hadamard_transform.hadamard_transform` computes it: in fp32, returned in `x.dtype`."""
    dim = x.shape[-1]
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-2 last dim, not {dim}")
    y = x.float().reshape(-1, dim)
    half = 1
    while half < dim:  # the butterflies of H_2n = [[H_n, H_n], [H_n, -H_n]]
        pairs = y.view(-1, dim // (2 * half), 2, half)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        half *= 2
    return (y.reshape(x.shape) * scale).to(x.dtype)


@functools.cache
def duplicated_linear() -> type:
    """Seam 2's class (made on first use: it subclasses a megatron class)."""
    from megatron.core.post_training.modelopt.layers import Linear

    class DuplicatedLinear(Linear):
        """Megatron's local replicated `Linear`, built as `TELinear(parallel_mode="duplicated")` is."""

        def __init__(self, *args: Any, parallel_mode: str | None = None, **kwargs: Any) -> None:
            if parallel_mode != "duplicated":
                raise ValueError(f"a replicated linear, not parallel_mode={parallel_mode!r}")
            super().__init__(*args, **kwargs)

    return DuplicatedLinear


def enable_dsa_without_extensions() -> None:
    """Seam 1: Megatron's DSA rotates with `walsh_hadamard` where `fast_hadamard_transform` is
    missing (and only there)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    if dsa.hadamard_transform is None:
        dsa.hadamard_transform = walsh_hadamard


def dsa_attention_spec(config: Any) -> Any:
    """Megatron's DSA core attention spec, as `get_dsa_module_spec_for_backend` makes it:
    `DSAttention` around a `DSAIndexer`, its linears `duplicated_linear()` (seam 2), its k norm
    Megatron's local LayerNorm."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )

    linear = duplicated_linear()

    class Backend(LocalSpecProvider):
        def linear(self) -> type:
            return linear

    return get_dsa_module_spec_for_backend(config, backend=Backend()).submodules.core_attention


def dsa_block_spec(config: Any, block: Any) -> Any:
    """`block` (Megatron's local `get_gpt_decoder_block_spec` for an MLA config) with each layer's
    core attention `dsa_attention_spec`'s. The rest of the MLA layer stays the local spec's."""
    core = dsa_attention_spec(config)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core
    return block


def presize_indexer_loss_tracker(config: Any, device: torch.device | str = "cpu") -> None:
    """Seam 3: the indexer-loss tracker with a slot for every decoder and MTP layer."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    slots = config.num_layers + (config.mtp_num_layers or 0)
    DSAIndexerLossLoggingHelper.tracker["values"] = torch.zeros(slots, device=device)


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
    layers = list(gpt.decoder.layers)
    if getattr(gpt, "mtp_process", False):
        layers += [mtp.transformer_layer for mtp in gpt.mtp.layers]
    with contextlib.ExitStack() as stack:
        records = {
            layer.layer_number - 1: stack.enter_context(scored(layer.self_attention.core_attention.indexer))
            for layer in layers
            if getattr(layer.self_attention.core_attention, "indexer", None) is not None
        }
        yield records
