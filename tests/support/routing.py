"""The experts each token was routed to, in Megatron and in transformers, to compare their logits
only where they routed alike (tests/support/tolerance.py); and the keys each of transformers' DSA indexers chose (Megatron's:
`megatron_dsa.recorded_selections`).

Both record, while on, {global layer index: [batch, seq, experts] bool} from the routers' own
outputs: Megatron's `TopKRouter` returns (probs, routing_map [seq·batch, experts]); transformers'
`*TopKRouter`s (Mixtral, Qwen3-MoE) and `*TopkRouter`s (DeepSeek-V3, GLM-4.5, GLM-5) return
(logits, scores, indices [batch·seq, k]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["hf_routing", "hf_selections", "megatron_routing"]

Routing = dict[int, torch.Tensor]


@contextlib.contextmanager
def megatron_routing(model_chunks: list[Any]) -> Iterator[Routing]:
    from orchestrator.adapters.megatron.convert.gather import unwrap_gpt

    chosen: Routing = {}

    def keep(layer: int) -> Any:
        def hook(module: Any, args: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, torch.Tensor]) -> None:
            seq, batch = args[0].shape[:2]  # the router's input is [seq, batch, hidden]
            chosen[layer] = out[1].view(seq, batch, -1).transpose(0, 1).clone()

        return hook

    handles = [
        layer.mlp.router.register_forward_hook(keep(layer.layer_number - 1))
        for chunk in model_chunks
        for layer in unwrap_gpt(chunk).decoder.layers
        if hasattr(layer.mlp, "router")
    ]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def hf_routing(model: Any, batch: int) -> Iterator[Routing]:
    chosen: Routing = {}

    def keep(layer: int) -> Any:
        def hook(module: Any, args: Any, out: tuple[torch.Tensor, ...]) -> None:
            indices = out[2]
            routed = torch.zeros(indices.shape[0], module.num_experts, dtype=torch.bool, device=indices.device)
            chosen[layer] = routed.scatter(1, indices, True).view(batch, -1, module.num_experts)

        return hook

    handles = [
        module.register_forward_hook(keep(int(name.split(".")[2])))  # model.layers.<i>.mlp.gate
        for name, module in model.named_modules()
        if type(module).__name__.lower().endswith("topkrouter")
    ]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def hf_selections(model: Any) -> Iterator[Routing]:
    """While on, the keys [batch, seq, topk] each DSA indexer of transformers' `model` chose, by
    layer (none for a model without DSA)."""
    chosen: Routing = {}

    def keep(layer: int) -> Any:
        def hook(_module: Any, _args: Any, out: torch.Tensor) -> None:
            chosen[layer] = out.long().clone()

        return hook

    handles = [
        layer.self_attn.indexer.register_forward_hook(keep(i))
        for i, layer in enumerate(model.model.layers)
        if getattr(layer.self_attn, "indexer", None) is not None
    ]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()
