"""The layer specs of every family colocate converts, made by Megatron-core's own spec functions,
with the few seams a host without Transformer Engine or Megatron's CUDA extensions needs.

    block = decoder_block_spec(config)             # the local (non-TE) spec of the config's layers
    gpt = GPTModel(config, block, mtp_block_spec=mtp_block_spec(config, block), ...)

What each version builds:

- Llama, Qwen3, Qwen3-MoE, Mixtral, GLM-4.5 and DeepSeek-V3 (MLA):
  `get_gpt_decoder_block_spec(config, use_transformer_engine=False)`, on 0.16 and 0.19 alike.
- GLM-5 (MLA with a DSA indexer): megatron-core 0.16 builds DSA layers only through Transformer
  Engine, so its MLA local spec gets DSA's core attention (`dsa_block_spec`). 0.19 refuses an
  experimental attention variant in `get_gpt_decoder_block_spec` and builds DSA layers through
  `get_transformer_layer_with_experimental_attention_variant_spec` (its `AbsorbedMLASelfAttention`
  around `DSAttention`); that function takes a backend, and here it is the local one.

The seams, each standing in for one missing piece and nothing else:

1. MLA's core attention (`mla_dot_product_attention`): `MLASelfAttention` passes `k_channels`
   and `v_channels` to its core attention, which only TE's `TEDotProductAttention` takes. This is
   Megatron's `DotProductAttention` taking them, its output `v_channels` wide per head; the math
   (scaled QK^T with MLA's softmax scale, causal softmax, probs·V) is Megatron's.
2. DSA's replicated linears (`duplicated_linear`): the indexer asks its backend for `linear()` (TE's
   `TELinear(parallel_mode="duplicated")`), which the local provider lacks; Megatron's own local
   replicated `Linear` stands in.
3. DSA's Hadamard rotation (`walsh_hadamard`): `fast_hadamard_transform`, a CUDA extension, is
   installed neither here nor on the GPU machine; the same transform in plain torch ops stands in,
   only where the extension is missing (`enable_dsa_without_extensions`).

And one fix: `presize_indexer_loss_tracker` sizes DSA's indexer-loss tracker for the MTP layers
too (it is sized by `num_layers`, and an MTP layer's DSA indexes past its end).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

__all__ = [
    "decoder_block_spec",
    "dsa_attention_spec",
    "dsa_block_spec",
    "duplicated_linear",
    "enable_dsa_without_extensions",
    "mla_dot_product_attention",
    "mtp_block_spec",
    "presize_indexer_loss_tracker",
    "walsh_hadamard",
]


def decoder_block_spec(config: Any) -> Any:
    """The local block spec of `config`'s decoder layers (this pipeline stage's), as the
    installed megatron-core builds that family."""
    if config.experimental_attention_variant == "dsa":
        enable_dsa_without_extensions()
        presize_indexer_loss_tracker(config, "cpu" if config.use_cpu_initialization else "cuda")
        if _builds_dsa_as_a_variant():
            return _dsa_variant_block_spec(config)
        return dsa_block_spec(config, _local_block_spec(config))
    spec = _local_block_spec(config)
    if config.multi_latent_attention:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = mla_dot_product_attention()
    return spec


def mtp_block_spec(config: Any, block: Any) -> Any:
    """Megatron's own local MTP block spec (its layer: the last decoder layer's); None without MTP
    or off the last pipeline stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, block, use_transformer_engine=False) if config.mtp_num_layers else None


def _local_block_spec(config: Any) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


def _builds_dsa_as_a_variant() -> bool:
    """Whether this megatron-core builds DSA layers as an experimental attention variant (0.19
    and later: `AbsorbedMLASelfAttention` exists), not inside the MLA spec (0.16)."""
    import importlib.util

    return importlib.util.find_spec("megatron.core.transformer.experimental_attention_variant.absorbed_mla") is not None


@functools.cache
def _local_backend() -> Any:
    """Megatron's local spec provider with seam 2's `linear()`."""
    from megatron.core.models.backends import LocalSpecProvider

    linear = duplicated_linear()

    class LocalBackend(LocalSpecProvider):
        def linear(self) -> type:
            return linear

    return LocalBackend()


def _dsa_variant_block_spec(config: Any) -> Any:
    """0.19's DSA layers: `get_transformer_layer_with_experimental_attention_variant_spec` on the
    local backend, sliced to this pipeline stage as its block function slices them (that
    function asks for TE's backend). The absorbed attention's down projections take a
    column-parallel linear where TE is missing (it accepts TE's `TELinear` or that), as
    Megatron's local MLA spec builds them."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    backend = _local_backend()
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        attention.linear_q_down_proj = ColumnParallelLinear
        attention.linear_kv_down_proj = ColumnParallelLinear
    offset = get_transformer_layer_offset(config)
    local = layers[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=backend.layer_norm(rms_norm=True, for_qk=False))


@functools.cache
def mla_dot_product_attention() -> type:
    """Seam 1's class (made on first use: it subclasses a megatron class)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """Megatron's `DotProductAttention`, taking MLA's `k_channels` and `v_channels`: the
        scores need no head width (they are q·k over whatever q and k hold, times the softmax
        scale MLA passes); the context is `v_channels` wide per head."""

        def __init__(self, config: Any, *, k_channels: int | None = None, v_channels: int | None = None, **kw: Any):
            if v_channels is not None:
                config = copy.copy(config)
                config.kv_channels = v_channels
            super().__init__(config=config, **kw)

    return MLADotProductAttention


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
    """Seam 3: Megatron's DSA rotates with `walsh_hadamard` where `fast_hadamard_transform` is
    missing (and only there)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    if dsa.hadamard_transform is None:
        dsa.hadamard_transform = walsh_hadamard


def dsa_attention_spec(config: Any) -> Any:
    """Megatron's DSA core attention spec, as `get_dsa_module_spec_for_backend` makes it:
    `DSAttention` around a `DSAIndexer`, its linears `duplicated_linear()` (seam 2), its k norm
    Megatron's local LayerNorm."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )

    return get_dsa_module_spec_for_backend(config, backend=_local_backend()).submodules.core_attention


def dsa_block_spec(config: Any, block: Any) -> Any:
    """0.16's DSA layers: `block` (Megatron's local `get_gpt_decoder_block_spec` for an MLA
    config) with each layer's core attention `dsa_attention_spec`'s. The rest of the MLA layer
    stays the local spec's."""
    core = dsa_attention_spec(config)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core
    return block


def presize_indexer_loss_tracker(config: Any, device: torch.device | str = "cpu") -> None:
    """The indexer-loss tracker with a slot for every decoder and MTP layer."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    slots = config.num_layers + (config.mtp_num_layers or 0)
    DSAIndexerLossLoggingHelper.tracker["values"] = torch.zeros(slots, device=device)
