"""Multi-token prediction (MTP): Megatron-core's `MultiTokenPredictionBlock` → the extra layer
DeepSeek-V3-style checkpoints (GLM-5's too) keep after the last decoder layer, which transformers
skips when it loads and SGLang loads as its NextN draft (`--speculative-algorithm NEXTN`/`EAGLE`).

MTP layer `j` of a model of `N` decoder layers becomes HF layer `N + j`:

| Megatron `mtp.layers.<j>.` | HF `model.layers.<N+j>.` |
| --- | --- |
| `enorm` (RMSNorm of the next token's embedding) | `enorm` |
| `hnorm` (RMSNorm of the previous depth's hidden state) | `hnorm` |
| `eh_proj` (columns `[embedding; hidden]`, as SGLang concatenates them) | `eh_proj` |
| `transformer_layer.<rest>` (0.19: `mtp_model_layer.<rest>`) | `<rest>`, as a decoder layer of the family |
| `final_layernorm` | `shared_head.norm` |

The checkpoint's `embed_tokens` and `shared_head.head` of that layer are the main model's
embedding and output head (Megatron's MTP calls the `GPTModel`'s own; at PP > 1 the last stage
keeps a copy of the embedding that Megatron keeps equal to the first stage's). SGLang skips both
and takes the target model's, so the sync sends neither, and never the last stage's copy.

The MTP layer is sent only when asked (`hf_buckets(..., mtp=True)`): an engine serving the
main model ignores it (transformers drops `model.layers.<N>.*`, SGLang skips layers past
`num_hidden_layers`), so by default it is left out, and `left_out` says so (`hf_buckets` logs it).
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.adapters.megatron.convert.rules import LAYER, MTP, compile_rules, same
from orchestrator.models import Family, ModelShape

__all__ = [
    "MTP_FAMILIES",
    "RULES",
    "global_name",
    "hf_config_keys",
    "inner_layer",
    "is_mtp",
    "left_out",
    "megatron_fields",
    "mtp_names",
    "numbered_layers",
    "shapes",
    "spec_problems",
]

# The families whose MTP layers convert (the layout is DeepSeek-V3's; checked for GLM-5).
MTP_FAMILIES = frozenset({Family.GLM_MOE_DSA})

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "shared_head.norm"}

RULES = compile_rules(
    (LAYER + rf"{megatron}\.weight", (f"model.layers.{{i}}.{hf}.weight",), same, MTP, MTP_FAMILIES)
    for megatron, hf in _OWN.items()
)


def is_mtp(name: str) -> bool:
    """Whether a Megatron name (local or global) is an MTP layer's."""
    return name.startswith("mtp.")


# The MTP layer's decoder layer: `transformer_layer` in megatron-core 0.16, `mtp_model_layer` in 0.19.
_INNER = ("transformer_layer", "mtp_model_layer")


def inner_layer(mtp_layer: Any) -> Any:
    """The decoder layer inside a `MultiTokenPredictionLayer`, under either version's name."""
    for name in _INNER:
        inner = getattr(mtp_layer, name, None)
        if inner is not None:
            return inner
    raise AttributeError(f"{type(mtp_layer).__name__} has none of {', '.join(_INNER)}")


def numbered_layers(gpt: Any) -> list[tuple[int, Any]]:
    """This stage's decoder layers by global index, then its MTP layers' decoder layers as
    `N + j` (an MTP layer's own `layer_number` counts the MTP layers; the decoder layer inside it
    is numbered 1 in 0.19, as the last decoder layer in 0.16)."""
    out = [(layer.layer_number - 1, layer) for layer in gpt.decoder.layers]
    if getattr(gpt, "mtp_process", False):
        out += [(gpt.config.num_layers + mtp.layer_number - 1, inner_layer(mtp)) for mtp in gpt.mtp.layers]
    return out


def global_name(name: str, gpt: Any) -> str:
    """`mtp.layers.<j>.<rest>` as the decoder layer it is in the checkpoint: its decoder layer's
    prefix (`_INNER`) dropped, its own modules kept, under `decoder.layers.<N + j>.` (`j` from the layer's own
    `layer_number`, which counts the MTP layers of earlier stages)."""
    match = _MTP_LAYER.match(name)
    if match is None:
        return name
    layer = gpt.mtp.layers[int(match[1])]
    index = gpt.config.num_layers + layer.layer_number - 1
    rest = name[match.end() :]
    for inner in _INNER:
        rest = rest.removeprefix(f"{inner}.")
    return f"decoder.layers.{index}.{rest}"


def megatron_fields(config: Any) -> dict[str, Any]:
    return {"mtp_num_layers": config.mtp_num_layers or 0}


def spec_problems(spec: ModelShape) -> list[str]:
    """MTP layers of a family whose conversion of them was not checked."""
    if not spec.mtp_num_layers or spec.family in MTP_FAMILIES:
        return []
    checked = ", ".join(sorted(f.value for f in MTP_FAMILIES))
    return [f"mtp_num_layers={spec.mtp_num_layers} (MTP layers are not converted for {spec.family}; for {checked})"]


def shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF shapes by module name (`shared_head.norm` is a `norm`)."""
    hidden = spec.hidden_size
    return {"enorm": (hidden,), "hnorm": (hidden,), "eh_proj": (hidden, 2 * hidden)}


def hf_config_keys(spec: ModelShape) -> dict[str, Any]:
    """How many MTP layers the checkpoint has: `num_nextn_predict_layers` is what GLM-5's and
    DeepSeek-V3's configs say and SGLang reads (DeepSeek-V3's config maps `num_mtp_layers` to it)."""
    return {"num_nextn_predict_layers": spec.mtp_num_layers, "num_mtp_layers": spec.mtp_num_layers}


def mtp_names(spec: ModelShape, layer_names: list[str]) -> list[str]:
    """The HF names of every MTP layer, given a decoder layer's (`layer_names`, under
    `model.layers.<i>.`, of the kind of the last decoder layer, whose spec Megatron's MTP reuses)."""
    own = [f"{hf}.weight" for hf in _OWN.values()]
    return [
        f"model.layers.{spec.num_layers + j}.{name}"
        for j in range(spec.mtp_num_layers)
        for name in [*own[:3], *layer_names, own[3]]
    ]


def left_out(names: list[str], mtp: bool) -> list[str]:
    """What a sync without `mtp` leaves out on purpose, as a sentence for a log (empty if nothing)."""
    dropped = sorted({m[0] for m in map(_MTP_LAYER.match, names) if m})
    if mtp or not dropped:
        return []
    return [
        f"MTP layer(s) {', '.join(p.rstrip('.') for p in dropped)} left out: the main model does not use them; "
        "hf_buckets(..., mtp=True) sends them as the checkpoint's layers after the last decoder layer "
        "(an engine's NextN draft)"
    ]
