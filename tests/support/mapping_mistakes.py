"""Sync results with a classic mapping mistake made on purpose: each must break the logits
tolerance of the conversion tests, or the match would prove nothing about that mapping.
A mistake takes the synced HF tensors (and the spec, where the layout needs it) and returns them
as the wrong mapping would have made them."""

from __future__ import annotations

import torch

from orchestrator.models import ModelShape

__all__ = [
    "as_is",
    "bias_dropped",
    "eh_proj_halves_swapped",
    "fc1_shards_whole",
    "grouped_untransposed",
    "indexer_rope_last",
    "kv_b_unheaded",
    "qkv_bias_ungrouped",
    "swap",
]


def swap(state: dict[str, torch.Tensor], a: str, b: str) -> dict[str, torch.Tensor]:
    """`state` with every name holding `a` and the same name holding `b` exchanged."""
    out = dict(state)
    for name in state:
        if a in name and name.replace(a, b) in state:
            out[name], out[name.replace(a, b)] = state[name.replace(a, b)], state[name]
    return out


def fc1_shards_whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TP=2 mistake: fc1's shards concatenated as they are, each a [gate; up] of its own
    (Mixtral's experts name gate and up `w1` and `w3`)."""
    out = dict(state)
    for name in state:
        for gate, up in (("gate_proj", "up_proj"), ("w1", "w3")):
            if name.endswith(f".{gate}.weight"):
                other = name.replace(f".{gate}.", f".{up}.")
                (g0, g1), (u0, u1) = state[name].chunk(2), state[other].chunk(2)
                out[name], out[other] = torch.cat([g0, u0]), torch.cat([g1, u1])
    return out


def grouped_untransposed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GroupedMLP mistake: an expert's blocks of weight1/weight2 read as SequentialMLP's
    [2·ffn, hidden] and [hidden, ffn] as they lie in memory, without the transpose."""
    out = dict(state)
    for name in state:
        if name.endswith(".w1.weight"):
            up, down = name.replace(".w1.", ".w3."), name.replace(".w1.", ".w2.")
            block1 = torch.cat([state[name].t(), state[up].t()], dim=1)  # [hidden, 2·ffn], as GroupedMLP holds it
            out[name], out[up] = block1.reshape(-1, block1.shape[0]).chunk(2)
            out[down] = state[down].t().reshape(state[down].shape)
    return out


def per_head_rows(state: dict[str, torch.Tensor], suffix: str, parts: list[int]) -> dict[str, torch.Tensor]:
    """The classic layout mistake: rows that are per head `[part 0; part 1; ...]` read as every
    head's part 0, then every head's part 1, ... (a split that ignores the heads)."""
    out = dict(state)
    for name, tensor in state.items():
        if name.endswith(suffix):
            heads = tensor.view(-1, sum(parts), *tensor.shape[1:]).split(parts, dim=1)
            unheaded = torch.cat([part.reshape(-1, *tensor.shape[1:]) for part in heads])
            out[name] = unheaded.view(-1, sum(parts), *tensor.shape[1:]).reshape(tensor.shape)
    return out


def kv_b_unheaded(state: dict[str, torch.Tensor], spec: ModelShape) -> dict[str, torch.Tensor]:
    """kv_b_proj read as [every head's k_nope; every head's v]: Megatron packs both per head."""
    return per_head_rows(state, "kv_b_proj.weight", [spec.qk_nope_head_dim, spec.v_head_dim])


def qkv_bias_ungrouped(state: dict[str, torch.Tensor], spec: ModelShape) -> dict[str, torch.Tensor]:
    """linear_qkv.bias split as three blocks, ignoring its per-group interleave."""
    out = dict(state)
    groups, projections = spec.num_query_groups, ("q_proj", "k_proj", "v_proj")
    for name in [n for n in state if n.endswith("q_proj.bias")]:
        q, k, v = (state[name.replace("q_proj", p)] for p in projections)
        fused = torch.cat([q.view(groups, -1), k.view(groups, -1), v.view(groups, -1)], dim=1).flatten()
        for p, part in zip(projections, fused.split([q.numel(), k.numel(), v.numel()]), strict=True):
            out[name.replace("q_proj", p)] = part
    return out


def bias_dropped(state: dict[str, torch.Tensor], spec: ModelShape) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t for n, t in state.items()}


def as_is(state: dict[str, torch.Tensor], spec: ModelShape) -> dict[str, torch.Tensor]:
    return state


def indexer_rope_last(state: dict[str, torch.Tensor], spec: ModelShape) -> dict[str, torch.Tensor]:
    """GLM-5's indexer mapped as Megatron lays it out: each head's rope dims last, not first (the
    mistake of mapping `linear_wq_b`, `linear_wk` and `k_norm` by name alone)."""
    head, rope = spec.dsa_index_head_dim, spec.qk_rope_head_dim
    out = dict(state)
    for name, tensor in state.items():
        if ".indexer." in name and "weights_proj" not in name:
            heads = tensor.reshape(-1, head, *tensor.shape[1:])
            rope_part, nope_part = heads.split([rope, head - rope], dim=1)
            out[name] = torch.cat([nope_part, rope_part], dim=1).reshape(tensor.shape)
    return out


def eh_proj_halves_swapped(state: dict[str, torch.Tensor], spec: ModelShape) -> dict[str, torch.Tensor]:
    """The MTP projection's input read as [hidden; embedding] (as some checkpoints order it, e.g.
    transformers' `mtp_hidden_states_first`), not Megatron's and SGLang's [embedding; hidden]."""
    out = dict(state)
    for name, tensor in state.items():
        if name.endswith("eh_proj.weight"):
            embedding, hidden = tensor.chunk(2, dim=1)
            out[name] = torch.cat([hidden, embedding], dim=1)
    return out
