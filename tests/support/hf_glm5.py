"""transformers' GLM-5 (`GlmMoeDsaForCausalLM`) against Megatron's, beyond the logits alone.

- **Megatron's selection.** Each DSA layer's top-k is a discrete decision: a bf16 near-tie at the
  k-th place flips a key in one framework and not the other, as a router's near-tie flips an
  expert. `forced_selections` runs transformers' model with each indexer's output replaced by
  the keys Megatron's indexer chose (`megatron_dsa.recorded_selections`), recording what its own
  indexer chose: the logits then check every other weight tightly, and the two selections, made
  from the same inputs, check the indexer's (`agreement`).
- **One indexer, the same inputs** (`indexer_selections`, `compare_selections`): Megatron's
  `DSAIndexer` and transformers' `GlmMoeDsaIndexer` loaded with its converted weights (and with
  the rope dims left where Megatron 0.16 keeps them, the mistake), given one x and q latent.
- **The MTP layer as SGLang's NextN draft runs it** (`nextn_logits`). transformers has no MTP head
  for `glm_moe_dsa` (it drops `model.layers.<N>.*` when it loads), so the draft is assembled from
  its parts: a `GlmMoeDsaForCausalLM` of N + 1 layers loads the synced checkpoint, its layer N
  being the MTP layer's decoder layer, and around that layer the NextN glue
  (`DeepseekModelNextN.forward` in SGLang, `MultiTokenPredictionLayer` in Megatron):

      h = norm(main model's last hidden state)               # what the main model's head reads
      e = embed(the next token)                              # token i+1 at position i (0 past the end)
      x = layer_N(eh_proj(cat(enorm(e), hnorm(h))))
      logits = lm_head(shared_head.norm(x))                  # token i+2

  `enorm`, `hnorm` and `shared_head.norm` are transformers' `GlmMoeDsaRMSNorm`, `eh_proj` a
  linear, each loaded from the synced tensor of that name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from orchestrator.adapters.megatron.convert import hf_config
from orchestrator.adapters.megatron.convert.spec import shape_from_megatron
from orchestrator.models import ModelShape
from tests.support.rounding import SIGMAS, drift, index_variance, leads, spread_of
from tests.support.routing import hf_routing, hf_selections

__all__ = [
    "Compared",
    "agreement",
    "compare_selections",
    "first_indexer_against_hf",
    "forced_selections",
    "indexer_selections",
    "load",
    "mtp_names_of",
    "nextn_logits",
]

_GLUE = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


def load(spec: ModelShape, state: dict[str, torch.Tensor], tmp: Path) -> tuple[Any, dict[str, list[str]]]:
    """`AutoModelForCausalLM.from_pretrained` of `hf_config(spec)` and `state`, as an engine loads
    a checkpoint; and its loading info."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf_config(spec).save_pretrained(tmp)
    save_file({k: t.contiguous() for k, t in state.items()}, tmp / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, output_loading_info=True)


@contextlib.contextmanager
def forced_selections(
    model: Any, selections: dict[int, dict[str, torch.Tensor]]
) -> Iterator[dict[int, dict[str, Any]]]:
    """While on, each DSA layer of `model` attends to the keys Megatron's chose
    (`selections[layer]["keys"]`); yields what its own indexer chose and was given, by layer
    (`routing.hf_selections`)."""

    def force(at: int) -> Any:
        def hook(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
            return selections[at]["keys"].to(out.device, out.dtype)

        return hook

    with hf_selections(model) as own:  # its hooks first: they see the indexer's own output
        hooks = [layer.self_attn.indexer.register_forward_hook(force(i)) for i, layer in enumerate(model.model.layers)]
        try:
            yield own
        finally:
            for hook in hooks:
                hook.remove()


@dataclasses.dataclass(frozen=True)
class Compared:
    """Of `queries` (layer and query, those with more keys than the top-k), how many chose other
    keys than Megatron's (`differ`); for each that did, Megatron's margin there in standard
    deviations of the two sides' rounding (`leads`, `tests/support/rounding.py`), how many of
    those are not near-ties (`far`: a lead of `SIGMAS` or more, which rounding does not reach),
    and how many were made from inputs that had drifted past what rounding does, downstream of a
    router's choice apart (`unjudged`: no rounding question); and the median lead over all
    queries."""

    queries: int
    differ: int
    leads: list[float]
    far: int
    unjudged: int
    median_lead: float


def selection_leads(
    megatron: dict[str, torch.Tensor], hf_inputs: dict[str, torch.Tensor] | None = None, layer: int = 0
) -> torch.Tensor:
    """[batch, seq] each query's lead (`rounding.leads`) in decoder layer `layer`'s indexer's
    record (`scored`): against transformers' inputs `hf_inputs` (`x`, `qr`) where it was handed
    its own, else on the same inputs as Megatron's."""
    token_drift = torch.zeros(megatron["scores"].shape[:2])
    if hf_inputs is not None:
        token_drift = torch.maximum(drift(megatron["x"], hf_inputs["x"]), drift(megatron["qr"], hf_inputs["qr"]))
    variance = index_variance(megatron["spread"], megatron["magnitude"], token_drift)
    # megatron-core 0.19 marks the slots of a query with fewer keys than the top-k as -1: those
    # land in a spare column, dropped.
    keys, n = megatron["keys"].long(), megatron["scores"].shape[-1]
    chosen = torch.zeros(*keys.shape[:-1], n + 1, dtype=torch.bool).scatter(-1, keys.where(keys >= 0, n), True)
    return leads(megatron["scores"], variance, chosen[..., :n], token_drift, layer)


def agreement(
    own: dict[int, dict[str, torch.Tensor]], megatron: dict[int, dict[str, torch.Tensor]], topk: int
) -> Compared:
    """Per layer of `own` (transformers' record: its `keys` [batch, seq, topk], and its inputs
    `x`, `qr` where they were its own rather than Megatron's) and query with more keys than the
    top-k (before, both take every key, and the masked ones they add are free), whether its key
    set is Megatron's, and Megatron's lead there."""
    differ, lead = [], []
    for layer, record in own.items():
        theirs = megatron[layer]
        differ.append((record["keys"].sort(-1).values != theirs["keys"].long().sort(-1).values).any(-1)[:, topk:])
        lead.append(selection_leads(theirs, record if "x" in record else None, layer)[:, topk:])
    differ_, lead_ = torch.cat(differ), torch.cat(lead)
    apart = lead_[differ_]
    return Compared(
        queries=differ_.numel(),
        differ=int(differ_.sum()),
        leads=[round(float(g), 2) for g in apart],
        far=int((apart >= SIGMAS).sum()),
        unjudged=int(apart.isnan().sum()),
        median_lead=round(float(lead_.nanmedian()), 2),
    )


def mtp_names_of(state: dict[str, Any], spec: ModelShape) -> list[str]:
    """The names of `state` in the MTP layers (HF layers `num_layers` and up)."""
    return [n for n in state if n.startswith("model.layers.") and int(n.split(".")[2]) >= spec.num_layers]


def _with_mtp_as_decoder(spec: ModelShape) -> ModelShape:
    """The spec of a model whose layer N is the MTP layer's decoder layer (of the last layer's kind)."""
    last = spec.num_layers - 1
    moe = (*spec.moe_layers, spec.num_layers) if last in spec.moe_layers else spec.moe_layers
    return dataclasses.replace(spec, num_layers=spec.num_layers + 1, moe_layers=moe, mtp_num_layers=0)


def nextn_logits(
    spec: ModelShape,
    state: dict[str, torch.Tensor],
    tokens: torch.Tensor,
    tmp: Path,
    selections: dict[int, dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, dict[int, dict[str, Any]], dict[int, dict[str, torch.Tensor]]]:
    """The NextN draft's logits [batch, seq, vocab] from the synced main and MTP tensors, every
    DSA layer (the MTP layer's too) on Megatron's `selections`; their spread
    (`rounding.spread_of`); its own indexers' records (`hf_selections`) and its routers'
    (`hf_routing`), the MTP layer's as layer N."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm

    if spec.mtp_num_layers != 1:
        raise ValueError(f"one MTP layer (SGLang's NextN), not {spec.mtp_num_layers}")
    n, hidden = spec.num_layers, spec.hidden_size
    model, info = load(_with_mtp_as_decoder(spec), state, tmp)
    glue = {f"model.layers.{n}.{part}.weight" for part in _GLUE}
    if set(info["unexpected_keys"]) != glue or info["missing_keys"] or info["mismatched_keys"]:
        raise AssertionError(f"the MTP layer did not load as decoder layer {n}: {info}")
    norms = {
        part: GlmMoeDsaRMSNorm(hidden, eps=spec.layernorm_epsilon) for part in ("enorm", "hnorm", "shared_head.norm")
    }
    eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
    for part, module in [*norms.items(), ("eh_proj", eh_proj)]:
        module.to(torch.bfloat16).weight.data.copy_(state[f"model.layers.{n}.{part}.weight"])

    following = torch.roll(tokens, -1, dims=-1)
    following[:, -1] = 0  # as Megatron's roll_tensor fills it
    core = model.model

    def glue_in(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        h = core.norm(args[0])
        e = core.embed_tokens(following)
        return (eh_proj(torch.cat([norms["enorm"](e), norms["hnorm"](h)], dim=-1)), *args[1:]), kwargs

    out: list[torch.Tensor] = []
    pre = core.layers[n].register_forward_pre_hook(glue_in, with_kwargs=True)
    post = core.layers[n].register_forward_hook(lambda _m, _i, result: out.append(result[0]))
    try:
        with torch.no_grad(), forced_selections(model, selections) as own, hf_routing(model, tokens.shape[0]) as routed:
            model(tokens)
            h = norms["shared_head.norm"](out[0])
            return model.lm_head(h).float(), spread_of(h, model.lm_head.weight), own, routed
    finally:
        pre.remove()
        post.remove()


def indexer_selections(indexer: Any, config: Any, seq: int, batch: int) -> dict[str, Any]:
    """Megatron's `indexer` (built from `config`, on its device) and transformers' indexer loaded
    with the converted weights, on the same random x and q latent: Megatron's record (`scored`:
    its scores [batch, seq, seq], keys [batch, seq, topk] and rounding terms) and each
    transformers indexer's keys (`hf_rope_last`: the rope dims left where Megatron 0.16 keeps
    them)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding

    from orchestrator.adapters.megatron.convert import to_hf
    from tests.support.mapping_mistakes import indexer_rope_last
    from tests.support.megatron_dsa import scored

    device = next(indexer.parameters()).device
    gpt = SimpleNamespace(  # the model's 16 positions (YaRN's factor 4 over 4), whatever `seq` is
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    spec = shape_from_megatron(config, gpt)
    x = torch.randn(seq, batch, config.hidden_size, device=device).bfloat16()
    qr = torch.randn(seq, batch, config.q_lora_rank, device=device).bfloat16()
    causal = torch.full((seq, seq), float("-inf"), device=device).triu(1)
    with torch.no_grad(), scored(indexer) as record:
        indexer.forward_with_scores(x, qr, mask=causal)
        prefix = "decoder.layers.0.self_attention.core_attention.indexer."
        weights = dict(pair for name, p in indexer.named_parameters() for pair in to_hf(prefix + name, p, spec))
        hf_config_ = hf_config(spec)
        positions = torch.arange(seq, device=device).expand(batch, seq)
        hidden, latent = x.transpose(0, 1), qr.transpose(0, 1)
        rope = GlmMoeDsaRotaryEmbedding(hf_config_).to(device)(hidden, positions)
        out: dict[str, Any] = {"megatron": {name: t.cpu() for name, t in record.items()}}
        for key, state in (("hf", weights), ("hf_rope_last", indexer_rope_last(weights, spec))):
            hf = GlmMoeDsaIndexer(hf_config_, 0).to(device, torch.bfloat16)
            hf.load_state_dict({name.split(".indexer.")[1]: tensor for name, tensor in state.items()})
            hf.weights_proj.float()  # as transformers keeps it when it loads (`_keep_in_fp32_modules`)
            out[key] = hf(hidden, latent, rope, causal.expand(batch, -1, -1), positions).cpu()
    return out


def compare_selections(selections: dict[str, Any], topk: int) -> tuple[Compared, Compared]:
    """`indexer_selections`' HF choices against Megatron's: as converted, and with the rope dims
    left last."""
    megatron = {0: selections["megatron"]}
    as_converted, rope_last = ({0: {"keys": selections[key].long()}} for key in ("hf", "hf_rope_last"))
    return agreement(as_converted, megatron, topk), agreement(rope_last, megatron, topk)


def first_indexer_against_hf(gpt: Any, seq: int = 64, batch: int = 4) -> dict[str, Any] | None:
    """`compare_selections` of this stage's first DSA layer (trained, in its bf16 model) on `seq`
    random queries; None where the stage has none."""
    layers = list(gpt.decoder.layers)
    indexer = getattr(layers[0].self_attention.core_attention, "indexer", None) if layers else None
    if indexer is None:
        return None
    found, rope_last = compare_selections(
        indexer_selections(indexer, gpt.config, seq, batch), gpt.config.dsa_indexer_topk
    )
    return {"found": dataclasses.asdict(found), "rope_last": dataclasses.asdict(rope_last)}
