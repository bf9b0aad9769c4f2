"""The experts each token was routed to, in Megatron and in transformers, to compare their logits
only where they routed alike.

Both record, while on, {global layer index: [batch, seq, experts] bool} from the routers' own
outputs: Megatron's `TopKRouter` returns (probs, routing_map [seq·batch, experts]); transformers'
`*TopKRouter`s (Mixtral, Qwen3-MoE) return (logits, scores, indices [batch·seq, k]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["hf_routing", "megatron_routing", "routed_alike"]

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
            routed = torch.zeros(indices.shape[0], module.num_experts, dtype=torch.bool)
            chosen[layer] = routed.scatter(1, indices, True).view(batch, -1, module.num_experts)

        return hook

    handles = [
        module.register_forward_hook(keep(int(name.split(".")[2])))  # model.layers.<i>.mlp.gate
        for name, module in model.named_modules()
        if type(module).__name__.endswith("TopKRouter")
    ]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


def routed_alike(megatron: Routing, hf: Routing, tokens: torch.Size) -> tuple[torch.Tensor, int]:
    """([batch, seq] bool: the tokens before the first one its sequence routed differently in any
    layer, which attention makes the only ones whose logits the two must share; the number of
    (token, layer) pairs routed differently)."""
    if sorted(megatron) != sorted(hf):
        raise ValueError(f"Megatron routed in layers {sorted(megatron)}, transformers in {sorted(hf)}")
    differ = torch.zeros(len(hf), *tokens, dtype=torch.bool)  # [layers, batch, seq]
    for row, layer in enumerate(sorted(hf)):
        differ[row] = (megatron[layer] != hf[layer]).any(dim=-1)
    after = differ.any(dim=0).int().cummax(dim=-1).values.bool()
    return ~after, int(differ.sum())
