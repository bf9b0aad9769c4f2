"""Decoding on an HF causal LM over one preallocated KV slab: what `TransformersEngine.generate` runs.

The slab holds every layer's cache in one storage, sized (max_batch, max_len), so the engine frees
and retakes the KV cache as one allocation. What a layer caches is the family's own: `cached_shapes`
reads it from one probe token through the model, so the slab has the shapes the attention hands to
`Cache.update` (and `Cache.update_indexer`), whatever they are:

- multi-head attention (Llama, Qwen3, Mixtral, GLM-4.5): keys and values [kv heads, head dim] a token;
- MLA (DeepSeek-V3, GLM-5), as transformers 5.24/5.25 cache it: the compressed latent
  [1, kv_lora_rank] as the "keys" and the rotated shared key [1, qk_rope_head_dim] as the "values",
  expanded to every head's keys and values only inside the attention;
- a DSA indexer (GLM-5's `GlmMoeDsaIndexer`): its keys [index_head_dim] a token, on the layers that
  run an indexer (a "shared" layer reuses the previous one's choice and caches none).

Each call decodes through a transformers `Cache` whose layers are views of the slab's first rows:
nothing of an earlier call is visible, and nothing is allocated beyond a scalar length per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicIndexedLayer, StaticIndexedLayer, StaticLayer

_ALIGN = 256  # bytes: where each cached tensor starts in the slab's one storage
_KINDS = ("keys", "values", "indexer")


@dataclass(frozen=True)
class Cached:
    """One tensor a layer caches, as its attention handed it to the cache for one row of one token:
    `shape` with batch and sequence 1, the sequence at `seq_dim`, batch first."""

    shape: tuple[int, ...]
    seq_dim: int
    dtype: torch.dtype

    def sized(self, batch: int, length: int) -> tuple[int, ...]:
        shape = [batch, *self.shape[1:]]
        shape[self.seq_dim] = length
        return tuple(shape)


class _Probe(DynamicIndexedLayer):
    """Records what the attention caches: keys and values, and indexer keys if it keeps any."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Cached] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen["keys"] = Cached(tuple(key_states.shape), 2, key_states.dtype)
        self.seen["values"] = Cached(tuple(value_states.shape), 2, value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        self.seen["indexer"] = Cached(tuple(indexer_key_states.shape), 1, indexer_key_states.dtype)
        return super().update_indexer(indexer_key_states)


def cached_shapes(model: PreTrainedModel) -> tuple[dict[str, Cached], ...]:
    """Per layer, what its attention caches ("keys", "values" and, for a DSA indexer, "indexer"):
    read from one token of one row through `model`, so the slab is shaped by the family's own code."""
    config = model.config.get_text_config(decoder=True)
    probes = [_Probe() for _ in range(config.num_hidden_layers)]
    device = model.lm_head.weight.device
    try:
        with torch.no_grad():
            model(
                input_ids=torch.zeros(1, 1, dtype=torch.int64, device=device),
                cache=Cache(layers=[*probes]),
                use_cache=True,
                logits_to_keep=1,
            )
    except RuntimeError as error:  # a config transformers' own forward cannot run
        raise ValueError(
            f"{type(model).__name__} cannot run one token (the KV slab's shapes are read from it): {error}"
        ) from error
    silent = [i for i, probe in enumerate(probes) if "keys" not in probe.seen]
    if silent:
        raise ValueError(f"{type(model).__name__}: layer(s) {silent} cached nothing; the KV slab needs every layer's")
    return tuple(probe.seen for probe in probes)


class KVSlab:
    """Every layer's cached tensors [max_batch, ..., max_len, ...], views of one uint8 `storage`:
    releasing the KV cache and taking it back is one resize each. Each view starts 256-byte aligned."""

    def __init__(
        self, shapes: tuple[dict[str, Cached], ...], max_batch: int, max_len: int, device: torch.device
    ) -> None:
        sizes = [
            {kind: math.prod(c.sized(max_batch, max_len)) * c.dtype.itemsize for kind, c in layer.items()}
            for layer in shapes
        ]
        total = sum(-(-n // _ALIGN) * _ALIGN for layer in sizes for n in layer.values())
        self.storage = torch.zeros(total, dtype=torch.uint8, device=device)
        self.layers: list[dict[str, torch.Tensor]] = []
        offset = 0
        for layer, layer_sizes in zip(shapes, sizes, strict=True):
            views = {}
            for kind in _KINDS:
                if kind in layer:
                    n, cached = layer_sizes[kind], layer[kind]
                    views[kind] = (
                        self.storage[offset : offset + n].view(cached.dtype).view(cached.sized(max_batch, max_len))
                    )
                    offset += -(-n // _ALIGN) * _ALIGN
            self.layers.append(views)

    def cache(self, batch: int) -> Cache:
        """An empty transformers cache over the slab's first `batch` rows: nothing of an earlier
        call is visible (every layer starts at length 0), and nothing is allocated."""
        return Cache(layers=[self._layer(views, batch) for views in self.layers])

    @staticmethod
    def _layer(views: dict[str, torch.Tensor], batch: int) -> StaticLayer:
        keys, values, indexer = views["keys"][:batch], views["values"][:batch], views.get("indexer")
        return _SlabLayer(keys, values) if indexer is None else _SlabIndexedLayer(keys, values, indexer[:batch])


def _fits(what: str, states: torch.Tensor, slab: torch.Tensor, seq_dim: int) -> None:
    if states.shape[:seq_dim] != slab.shape[:seq_dim] or states.shape[seq_dim + 1 :] != slab.shape[seq_dim + 1 :]:
        raise ValueError(f"{what} {tuple(states.shape)} do not fit the KV slab's {tuple(slab.shape)}")
    if states.dtype != slab.dtype:
        raise ValueError(f"{what} are {states.dtype}, the KV slab's {slab.dtype}")


class _SlabLayer(StaticLayer):
    """A `StaticLayer` over given tensors: HF's own allocates fresh ones at its first update.

    `keys` and `values` are [batch, heads, max_len, dim] views of the engine's KV slab (of the
    shapes the family's attention caches), so a batch smaller than `max_batch` uses the slab's first
    rows and allocates nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(max_cache_len=keys.shape[2])
        self._slab = (keys, values)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        keys, values = self._slab
        _fits("key states", key_states, keys, 2)
        _fits("value states", value_states, values, 2)
        # The attributes StaticLayer.lazy_initialization sets, minus its allocation.
        self.keys, self.values = keys, values
        self.device = keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True


class _SlabIndexedLayer(_SlabLayer, StaticIndexedLayer):
    """A `_SlabLayer` that also keeps a DSA indexer's keys [batch, max_len, dim] in the slab, as
    `StaticIndexedLayer` keeps them in a tensor of its own."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, indexer: torch.Tensor) -> None:
        super().__init__(keys, values)
        self._indexer_slab = indexer

    def lazy_initialization_indexer(self, indexer_key_states: torch.Tensor) -> None:
        _fits("indexer key states", indexer_key_states, self._indexer_slab, 1)
        # The attributes StaticIndexedLayer.lazy_initialization_indexer sets, minus the keys' allocation.
        self.indexer_keys = self._indexer_slab
        self.indexer_dtype, self.indexer_device = self.indexer_keys.dtype, self.indexer_keys.device
        self.indexer_cumulative_length = torch.zeros((), dtype=torch.long, device=self.indexer_device)
        self.is_indexer_initialized = True


def kv_slab(model: PreTrainedModel, max_batch: int, max_len: int) -> KVSlab:
    """The slab for `model`: what each of its layers caches (`cached_shapes`), for max_batch rows of max_len tokens."""
    return KVSlab(cached_shapes(model), max_batch, max_len, model.lm_head.weight.device)


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T), and its log-probability under that distribution."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)
    return tokens.squeeze(1), logprobs.gather(1, tokens).squeeze(1)


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's most likely token, and its log-probability at temperature 1. The argmax is of
    the logits themselves, as HF's greedy search takes it (the first of a tie): log_softmax's
    rounding could merge two close logits into a tie the logits do not have."""
    tokens = logits.argmax(dim=-1, keepdim=True)
    return tokens.squeeze(1), torch.log_softmax(logits.float(), dim=-1).gather(1, tokens).squeeze(1)


def prompt_problems(
    prompts: torch.Tensor, max_new_tokens: int, temperature: float, max_batch: int, max_len: int, vocab_size: int
) -> list[str]:
    """What is wrong with a `generate` call for a slab of (max_batch, max_len); empty if nothing."""
    problems = []
    if prompts.dim() != 2 or prompts.dtype != torch.int64:
        problems.append(f"prompts must be [B, P] int64, got {tuple(prompts.shape)} {prompts.dtype}")
    elif prompts.shape[0] > max_batch:
        problems.append(f"batch {prompts.shape[0]} exceeds max_batch {max_batch}")
    elif prompts.shape[1] + max_new_tokens > max_len:
        problems.append(f"{prompts.shape[1]} prompt + {max_new_tokens} new tokens exceed max_len {max_len}")
    elif prompts.numel() and not 0 <= int(prompts.min()) <= int(prompts.max()) < vocab_size:
        problems.append(f"token ids outside [0, {vocab_size})")
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        problems.append(f"temperature must be > 0, got {temperature}")
    return problems


def decode(
    model: PreTrainedModel,
    kv: KVSlab,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float | None,
    seed: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `max_new_tokens` after each row of `prompts` (checked by `prompt_problems`), one
    token a step through the slab; returns (completions [B, N] int64, logprobs [B, N] float32).

    `temperature=None` decodes greedily instead (`_greedy`: argmax, log-probs at T = 1), as HF's
    `generate(do_sample=False)` does; `TransformersEngine.generate` never asks for it (its callers
    sample at T > 0), the tests do, to compare completions with transformers' own token for token."""
    batch, prompt_len = prompts.shape
    generator = torch.Generator(device).manual_seed(seed)
    completions = torch.empty(batch, max_new_tokens, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, max_new_tokens, dtype=torch.float32, device=device)
    cache = kv.cache(batch)
    inputs, positions = prompts.to(device), torch.arange(prompt_len, device=device)
    with torch.no_grad():
        for step in range(max_new_tokens):
            out = model(input_ids=inputs, position_ids=positions[None], cache=cache, use_cache=True, logits_to_keep=1)
            last = out.logits[:, -1]
            token, logprob = _greedy(last) if temperature is None else _sample(last, temperature, generator)
            completions[:, step], logprobs[:, step] = token, logprob
            inputs, positions = token[:, None], positions[-1:] + 1
    return completions, logprobs
