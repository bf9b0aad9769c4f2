"""Decoding on an HF causal LM over one preallocated KV slab: what `TransformersEngine.generate` runs.

The slab is one tensor for every layer's keys and values, sized (max_batch, max_len), so the
engine frees and retakes the KV cache as one storage. Each call decodes through a transformers
`Cache` whose layers are views of the slab's first rows: nothing of an earlier call is visible,
and nothing is allocated.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer


class _SlabLayer(StaticLayer):
    """A `StaticLayer` over given tensors: HF's own allocates fresh ones at its first update.

    `keys` and `values` are [batch, kv_heads, max_len, head_dim] views of the engine's KV slab, so a
    batch smaller than `max_batch` uses the slab's first rows and allocates nothing.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(max_cache_len=keys.shape[2])
        self._slab = (keys, values)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        keys, values = self._slab
        if key_states.shape[:2] != keys.shape[:2] or key_states.shape[-1] != keys.shape[-1]:
            raise ValueError(f"key states {tuple(key_states.shape)} do not fit the KV slab {tuple(keys.shape)}")
        # The attributes StaticLayer.lazy_initialization sets, minus its allocation.
        self.keys, self.values = keys, values
        self.device = keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T), and its log-probability under that distribution."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)
    return tokens.squeeze(1), logprobs.gather(1, tokens).squeeze(1)


def kv_slab(config: PretrainedConfig, model: PreTrainedModel, max_batch: int, max_len: int) -> torch.Tensor:
    """[keys | values, layer, batch, kv head, position, head dim]: one storage to free and retake."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    weight = model.lm_head.weight
    shape = (2, config.num_hidden_layers, max_batch, kv_heads, max_len, head_dim)
    return torch.zeros(shape, dtype=weight.dtype, device=weight.device)


def slab_cache(kv: torch.Tensor, batch: int) -> Cache:
    """An empty transformers cache over the slab's first `batch` rows: nothing of an earlier
    call is visible (every layer starts at length 0), and nothing is allocated."""
    keys, values = kv
    return Cache(layers=[_SlabLayer(k[:batch], v[:batch]) for k, v in zip(keys, values, strict=True)])


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
    kv: torch.Tensor,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `max_new_tokens` after each row of `prompts` (checked by `prompt_problems`), one
    token a step through the slab; returns (completions [B, N] int64, logprobs [B, N] float32)."""
    batch, prompt_len = prompts.shape
    generator = torch.Generator(device).manual_seed(seed)
    completions = torch.empty(batch, max_new_tokens, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, max_new_tokens, dtype=torch.float32, device=device)
    cache = slab_cache(kv, batch)
    inputs, positions = prompts.to(device), torch.arange(prompt_len, device=device)
    with torch.no_grad():
        for step in range(max_new_tokens):
            out = model(input_ids=inputs, position_ids=positions[None], cache=cache, use_cache=True, logits_to_keep=1)
            token, logprob = _sample(out.logits[:, -1], temperature, generator)
            completions[:, step], logprobs[:, step] = token, logprob
            inputs, positions = token[:, None], positions[-1:] + 1
    return completions, logprobs
