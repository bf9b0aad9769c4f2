"""The transformers engine's rollouts for every family of the support table: its KV slab holds
what the family's own attention caches, and its decode through that slab gives transformers' own
greedy completions on the same weights, token for token.

Each family is built tiny (tests/support/family_shapes.py) with random weights, synced into a
`TransformersEngine` as a trainer's sync would (checkpoint names), and the same checkpoint loaded
by transformers' own `from_pretrained`: the reference is HF's `generate(do_sample=False)` with its
default dynamic cache, a path that shares nothing with the engine's slab. The engine samples at
T > 0 in `generate`; here it decodes greedily through the same `decode` over the same slab
(`temperature=None`, decode.py), the only difference being argmax for sampling.

Why fp32, and why exact equality. Both sides run the same prefill and one-token steps; they
differ only in the attention's length (the slab's max_len positions, those past the sequence
masked, against the dynamic cache's filled ones) and so in the reductions' order: fp32 rounding,
a few units of 2^-24 of a logit of about 1. A greedy token flips only where the top two logits are
closer than that. For random weights the gap between a step's top two of 128 logits has a density
of order 1 per unit of logit near 0 (its mean is about a third of a logit), so a flip has odds of
order 1e-6 a step, and the few hundred steps here have odds under 1e-3 of one. In bf16 the
rounding (2^-8 a rounding, over dozens) would make near-ties common, as they are in
test_families.py, whose tolerance is routing-aware for that reason.

A DSA indexer's top-k is a discrete choice too, and it has exact ties: a key's score is a sum over
the indexer's heads of weight x relu(q . k), so a key every head scores below 0 scores exactly 0,
and several such keys can share the k-th place. Which of them `topk` keeps is its own tie-break,
which differs between the slab's max_len scores and the dynamic cache's filled ones; the choice
then differs though neither side is wrong. So a row is compared up to the first forward in which
either side's indexer met an exact tie at its k-th place (`_indexer_ties`), and most tokens must be
compared.

MTP (NextN). DeepSeek-V3 and GLM-5 train MTP layers in Megatron; transformers' classes do not
build them (`from_pretrained` drops `model.layers.<N>.*`), and the engine decodes one token a step
through the main model, with no speculative draft. So there is no MTP path in the engine's
rollouts to check; the MTP layer as SGLang's NextN draft would run it is checked against Megatron
in test_families.py (tests/support/hf_glm5.py, `nextn_logits`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from orchestrator.adapters.engines.decode import decode
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.convert import hf_config
from orchestrator.models import Family
from orchestrator.plan.model import kv_bytes_per_token
from states import EngineMemory
from tests.support.family_shapes import SHAPES, shapes_cover_support

MAX_BATCH, MAX_LEN = 4, 24
PROMPT, NEW = 6, 10  # 16 positions: past the DSA indexer's top 4, and YaRN's 16 original ones
_ALIGN = 256


def _config(family: Family, *, shared_indexer: bool = False) -> Any:
    config = hf_config(SHAPES[family])
    config.dtype = torch.float32
    if shared_indexer:  # GLM-5's "shared" DSA layers: they reuse the previous layer's top-k, cache no indexer keys
        config.indexer_types = ["full", "shared", "full"]
    return config


CASES = {family.value: (family, False) for family in SHAPES} | {
    "glm_moe_dsa shared indexer": (Family.GLM_MOE_DSA, True)
}


def _synced(config: Any, seed: int = 0) -> TransformersEngine:
    """An engine of `config` with random weights of O(1) activations, loaded by checkpoint name."""
    engine = TransformersEngine(config, max_batch=MAX_BATCH, max_len=MAX_LEN, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    named = []
    for name, tensor in sorted(engine.weights().items()):
        values = torch.randn(tensor.shape, generator=generator)
        values = 1 + 0.2 * values if tensor.dim() == 1 else values / tensor.shape[-1] ** 0.5
        named.append((name, values.to(tensor.dtype)))
    engine.update_weights(named, version=1)
    return engine


def _reference(engine: TransformersEngine, tmp: Path) -> Any:
    """transformers' own model of the engine's config, loaded by `from_pretrained` from what the engine serves."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    engine.config.save_pretrained(tmp)
    save_file({k: t.contiguous() for k, t in engine.weights().items()}, tmp / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # No stop token: the engine has none, and an EOS would end HF's rows early.
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return model.eval()


def _prompts(vocab: int, batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def _indexer_ties(model: Any) -> Iterator[list[torch.Tensor]]:
    """While on, one [batch] bool per forward of `model`: whether a DSA indexer chose, for any query
    of that row, among exactly equal finite scores at its k-th place (none for a model without DSA).
    The indexer's only `topk` is its selection; it is watched only while an indexer runs."""
    forwards: list[torch.Tensor] = []
    real = torch.Tensor.topk

    def watched(scores: torch.Tensor, k: int, *args: Any, **kwargs: Any) -> Any:
        if scores.shape[-1] > k:
            ranked = scores.sort(dim=-1, descending=True).values
            kth, after = ranked[..., k - 1], ranked[..., k]
            forwards[-1] |= ((kth == after) & torch.isfinite(after)).flatten(1).any(1)
        return real(scores, k, *args, **kwargs)

    def begin(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        forwards.append(torch.zeros(kwargs["input_ids"].shape[0], dtype=torch.bool))

    def watch(*_: Any) -> None:
        torch.Tensor.topk = watched  # type: ignore[method-assign]

    def unwatch(*_: Any) -> None:
        torch.Tensor.topk = real  # type: ignore[method-assign]

    indexers = [layer.self_attn.indexer for layer in model.model.layers if getattr(layer.self_attn, "indexer", None)]
    handles = [model.register_forward_pre_hook(begin, with_kwargs=True)]
    handles += [i.register_forward_pre_hook(watch) for i in indexers] + [
        i.register_forward_hook(unwatch) for i in indexers
    ]
    try:
        yield forwards
    finally:
        unwatch()
        for handle in handles:
            handle.remove()


def _comparable(ours: list[torch.Tensor], theirs: list[torch.Tensor], batch: int) -> torch.Tensor:
    """[batch]: how many leading tokens of each row no indexer tie can have decided (token s comes of forward s)."""
    tied = torch.stack(ours[:NEW]) | torch.stack(theirs + [torch.zeros(batch, dtype=torch.bool)] * (NEW - len(theirs)))
    first = torch.where(tied.any(0), tied.int().argmax(0), NEW)
    return first


def test_every_family_of_the_support_table_has_a_shape() -> None:
    assert not shapes_cover_support()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_completions_equal_transformers_own(case: str, tmp_path: Path) -> None:
    """Token for token, at full batch and at a smaller one (the slab's first rows)."""
    family, shared = CASES[case]
    engine = _synced(_config(family, shared_indexer=shared))
    reference = _reference(engine, tmp_path)
    for batch in (MAX_BATCH, 2):
        prompts = _prompts(engine.config.vocab_size, batch)
        with _indexer_ties(engine.model) as our_ties:
            ours, logprobs = decode(
                engine.model, engine._slab, prompts, max_new_tokens=NEW, temperature=None, seed=0, device=engine.device
            )
        with torch.no_grad(), _indexer_ties(reference) as their_ties:
            out = reference.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=NEW,
                output_scores=True,
                return_dict_in_generate=True,
            )
        theirs = out.sequences[:, PROMPT:]
        assert theirs.shape == ours.shape == (batch, NEW)
        assert len(set(ours.flatten().tolist())) > 1, "a model that repeats one token would prove little"
        expected = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1).gather(2, theirs[..., None])
        compared = _comparable(our_ties, their_ties, batch)
        for row, n in enumerate(compared.tolist()):
            assert torch.equal(ours[row, :n], theirs[row, :n]), f"{case}, batch {batch}, row {row}: first {n} tokens"
            torch.testing.assert_close(logprobs[row, :n], expected[row, :n, 0], atol=1e-4, rtol=0)
        print(f"\n{case}, batch {batch}: {compared.tolist()} of {NEW} tokens a row before an indexer tie")
        assert compared.sum() * 2 >= batch * NEW, f"{compared.tolist()}: too few tokens compared to judge"


def _expected_slab_bytes(config: Any) -> int:
    """What the family's attention caches, from its HF config by hand (transformers 5.24/5.25):
    keys and values per KV head; MLA's latent and rotated key, one "head" each; GLM-5's indexer keys
    on its "full" layers."""
    rows = MAX_BATCH * MAX_LEN * 4  # fp32
    per_layer: list[list[int]] = []
    for layer in range(config.num_hidden_layers):
        if getattr(config, "kv_lora_rank", None):
            dims = [config.kv_lora_rank, config.qk_rope_head_dim]
            if getattr(config, "indexer_types", None) and config.indexer_types[layer] == "full":
                dims.append(config.index_head_dim)
        else:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            dims = [config.num_key_value_heads * head_dim] * 2
        per_layer.append(dims)
    return sum(-(-rows * d // _ALIGN) * _ALIGN for dims in per_layer for d in dims)


@pytest.mark.parametrize("case", list(CASES))
def test_the_slab_holds_what_the_family_caches_and_every_cached_tensor_is_a_view_of_it(case: str) -> None:
    """The footprint is the slab's bytes, those of the family's own cache shapes (counted by hand
    here); a forward through a cache of the slab's first rows writes only into the slab, and
    release/resume frees and retakes it as one storage."""
    family, shared = CASES[case]
    engine = _synced(_config(family, shared_indexer=shared))
    slab = engine._slab
    assert engine.footprint()[EngineMemory.KV_CACHE] == slab.storage.nbytes == _expected_slab_bytes(engine.config)
    if not shared:  # and what the planner counts a token takes (in bf16; the slab here is fp32)
        assert slab.storage.nbytes == 2 * kv_bytes_per_token(SHAPES[family]) * MAX_BATCH * MAX_LEN
    start, end = slab.storage.data_ptr(), slab.storage.data_ptr() + slab.storage.nbytes
    cache = slab.cache(2)
    with torch.no_grad():
        engine.model(input_ids=_prompts(engine.config.vocab_size, 2), cache=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        held = [layer.keys, layer.values] + (
            [layer.indexer_keys] if getattr(layer, "indexer_keys", None) is not None else []
        )
        for tensor in held:
            assert start <= tensor.data_ptr() < end and tensor.shape[0] == 2, f"layer {i}: {tuple(tensor.shape)}"
        assert int(layer.get_seq_length()) == PROMPT
    indexed = sum(getattr(layer, "indexer_keys", None) is not None for layer in cache.layers)
    assert indexed == sum(t == "full" for t in getattr(engine.config, "indexer_types", []))
    engine.release(frozenset({EngineMemory.KV_CACHE}))
    assert slab.storage.untyped_storage().nbytes() == 0
    engine.resume(frozenset({EngineMemory.KV_CACHE}))
    assert slab.storage.untyped_storage().nbytes() == engine.footprint()[EngineMemory.KV_CACHE]
    completions, logprobs = engine.generate(
        _prompts(engine.config.vocab_size, 3), max_new_tokens=NEW, temperature=1.0, seed=0
    )
    assert completions.shape == (3, NEW) and (logprobs < 0).all() and math.isfinite(float(logprobs.sum()))
