"""The experts each token was routed to, in Megatron and in transformers, to compare their logits
only where they routed alike (tests/support/tolerance.py); and the keys each of transformers' DSA indexers chose (Megatron's:
`megatron_dsa.recorded_selections`).

Both record, while on, {global layer index: record}, each record's `map` [batch, seq, experts]
bool from the routers' own outputs (Megatron's `TopKRouter` returns (probs, routing_map
[seq·batch, experts]); transformers' `*TopKRouter`s (Mixtral, Qwen3-MoE) and `*TopkRouter`s
(DeepSeek-V3, GLM-4.5, GLM-5) return (logits, scores, indices [batch·seq, k])) and its input `x`
[batch, seq, hidden]. Megatron's also holds what `rounding.route_leads` reads: the scores its
top-k chose from (`scores`: logits, or sigmoid scores plus `expert_bias`), what each one's
rounding reads (`spread`: sum_d x_d² W_ed², `value`: the logit squared, both times the score
function's slope squared) and its `groups` (group-limited routing: groups, groups chosen).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from orchestrator.adapters.megatron.convert.mtp import numbered_layers

__all__ = ["hf_routing", "hf_selections", "megatron_routing"]

Routing = dict[int, dict[str, torch.Tensor]]


@contextlib.contextmanager
def megatron_routing(model_chunks: list[Any]) -> Iterator[Routing]:
    from orchestrator.adapters.megatron.convert.gather import unwrap_gpt

    chosen: Routing = {}

    def keep(layer: int) -> Any:
        def hook(module: Any, args: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, torch.Tensor]) -> None:
            seq, batch = args[0].shape[:2]  # the router's input is [seq, batch, hidden]
            x = args[0].detach().transpose(0, 1).float()  # [batch, seq, hidden]
            weight = module.weight.detach().float()
            logits = x @ weight.T
            spread = x.square() @ weight.square().T
            config = module.config
            scores, slope = logits, torch.ones_like(logits)
            if config.moe_router_score_function == "sigmoid":
                scores = logits.sigmoid()
                slope = scores * (1 - scores)
            if getattr(module, "expert_bias", None) is not None:
                scores = scores + module.expert_bias.detach().float()
            chosen[layer] = {
                "map": out[1].view(seq, batch, -1).transpose(0, 1).clone(),
                "x": x.clone(),
                "scores": scores,
                "spread": spread * slope.square(),
                "value": (logits * slope).square(),
                "groups": torch.tensor([config.moe_router_num_groups or 1, config.moe_router_group_topk or 1]),
            }

        return hook

    # by global layer: the decoder's, then each MTP layer's as `N + j`
    layers = [pair for chunk in model_chunks for pair in numbered_layers(unwrap_gpt(chunk))]
    handles = [
        layer.mlp.router.register_forward_hook(keep(index)) for index, layer in layers if hasattr(layer.mlp, "router")
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
            chosen[layer] = {
                "map": routed.scatter(1, indices, True).view(batch, -1, module.num_experts),
                "x": args[0].detach().reshape(batch, -1, args[0].shape[-1]).clone(),
            }

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
    """While on, what each DSA indexer of transformers' `model` chose and was given, by layer
    (none for a model without DSA): its `keys` [batch, seq, topk], and its inputs `x` and `qr`
    [batch, seq, dim] (against Megatron's, their drift: `tests/support/rounding.py`)."""
    chosen: Routing = {}

    def given(layer: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            inputs = dict(zip(("hidden_states", "q_resid"), args, strict=False)) | kwargs
            chosen[layer] = {"x": inputs["hidden_states"].detach().clone(), "qr": inputs["q_resid"].detach().clone()}

        return hook

    def keep(layer: int) -> Any:
        def hook(_module: Any, _args: Any, out: torch.Tensor) -> None:
            chosen[layer]["keys"] = out.long().clone()

        return hook

    indexers = [
        (i, layer.self_attn.indexer)
        for i, layer in enumerate(model.model.layers)
        if getattr(layer.self_attn, "indexer", None) is not None
    ]
    handles = [indexer.register_forward_pre_hook(given(i), with_kwargs=True) for i, indexer in indexers]
    handles += [indexer.register_forward_hook(keep(i)) for i, indexer in indexers]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()
