"""A real rollout engine on transformers' own model class for the family (`LlamaForCausalLM`,
`Qwen3MoeForCausalLM`, ...), with memory that really goes away.

Implements `orchestrator.protocols.RolloutEngine` the way SGLang behaves, on CPU or one GPU:

- `weights`: the model's params (and persistent buffers, such as a router's
  `e_score_correction_bias`), all views of one storage. Released by resizing it to 0 bytes
  (contents lost); resumed by resizing it back (contents undefined until the next complete sync):
  one allocation each way, not one a param. Weights arrive under their checkpoint names, each
  written where `from_pretrained` would put it (`checkpoint.checkpoint_views`: an MoE's experts
  into rows of its fused expert params).
- `kv_cache`: one preallocated storage for every layer's cache, sized (max_batch, max_len), of
  the shapes the family's own attention caches (decode.py reads them from one probe token: keys
  and values per KV head; MLA's compressed latent and rotated key; a DSA indexer's keys). Each
  `generate` runs on the first rows of it, through a transformers `Cache` whose layers are views
  of it. Released and resumed like the weights. Rollouts decode one token a step through the
  main model: MTP (NextN) layers, which transformers' classes do not load, are not used.
- `cuda_graph`: accepted and recorded; this engine captures no graphs, so nothing is freed.

`released()` reports the tags whose storage is freed now. Releasing a released tag or resuming a
resident one is a no-op with a note (`note_noop`); a release while a request is in flight is
refused before anything is freed.

The engine serves a version once every checkpoint name has been loaded at that version
(`update_weights` takes one bucket at a time). Like SGLang, it keeps reporting that version after
its weights are released, but it refuses to generate until a complete sync has refilled them.

Single-threaded: `is_idle` is False only while `generate` or `logits` runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from orchestrator.adapters.digest import sha256_digests
from orchestrator.adapters.engines.checkpoint import CheckpointSlots, live_tensors
from orchestrator.adapters.engines.decode import decode, kv_slab, prompt_problems
from orchestrator.adapters.megatron.convert import hf_config
from orchestrator.adapters.megatron.gpt import GPTConfig, TinyGPTConfig
from orchestrator.adapters.regions.storage import return_large_frees_to_the_os
from orchestrator.adapters.transport.bucketed import nbytes
from orchestrator.errors import EngineError
from orchestrator.models import ModelShape
from orchestrator.protocols import EngineDefaults, EngineFeatures
from orchestrator.telemetry.logs import note_noop
from states import EngineMemory

_ALIGN = 256  # bytes: where each param starts in the engine's one weight storage

__all__ = ["TransformersEngine"]


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _build_model(config: PretrainedConfig, device: torch.device) -> PreTrainedModel:
    with device:  # built in place: no copy of throwaway weights from the host
        model = AutoModelForCausalLM.from_config(config)  # params in config.dtype; RoPE buffers stay fp32
    # transformers 5.x renamed forward's `past_key_values` to `cache` (5.17 lacks it, 5.24 has it);
    # an older build would take `cache` into **kwargs and decode every token without its context.
    if "cache" not in inspect.signature(type(model).forward).parameters:
        raise ImportError(
            f"TransformersEngine needs a transformers whose {type(model).__name__}.forward takes `cache` "
            f"(5.24 does); this is {transformers.__version__}"
        )
    return model.eval().requires_grad_(False)


def _check_bucket(engine: str, named: Sequence[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor]) -> None:
    unknown = sorted({name for name, _ in named if name not in params})
    if unknown:
        raise ValueError(f"engine {engine}: unknown weight name(s): {', '.join(unknown)}")
    wrong = [
        f"{name} {tuple(t.shape)} (expected {tuple(params[name].shape)})"
        for name, t in named
        if t.shape != params[name].shape
    ]
    if wrong:
        raise ValueError(f"engine {engine}: wrong shape(s): {', '.join(wrong)}")


def _note_dtypes(
    sent: dict[str, torch.dtype], named: Sequence[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor]
) -> None:
    """Keep in `sent` the dtype of each weight of a bucket sent in another dtype than its param's
    (HF keeps DeepSeek-V3's and GLM's router weights in fp32; Megatron's are bf16)."""
    for name, tensor in named:
        if tensor.dtype != params[name].dtype:
            sent[name] = tensor.dtype
        else:
            sent.pop(name, None)


def _digests_as_sent(held: dict[str, torch.Tensor], sent: dict[str, torch.dtype]) -> dict[str, str]:
    """SHA256 of each tensor, in the dtype it was sent in (`sent`) where the cast back is exact;
    where it is not, the param holds values no tensor of that dtype has, and the digest says so."""
    inexact = {}
    for name, dtype in sent.items():
        cast = held[name].to(dtype)
        if torch.equal(cast.to(held[name].dtype), held[name]):
            held[name] = cast
        else:
            inexact[name] = f"holds values no {dtype} tensor has"  # never a SHA256
    return sha256_digests(held) | inexact


def _return_freed_pages(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Each source into its target, cast to the target's dtype, as SGLang's loader does."""
    with torch.no_grad():
        if all(t.dtype == s.dtype and t.device == s.device for t, s in zip(targets, sources, strict=True)):
            torch._foreach_copy_(targets, sources)  # one multi-tensor launch, not one per tensor
        else:
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source)


def _one_storage(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Move every param into one storage and make it a view there: releasing the weights and
    taking them back is then one allocation each, not one a param (a few hundred for a 1 B model).
    Each param starts 256-byte aligned, as an allocator would place it."""
    params = list(params)
    sizes = [-(-nbytes(p) // _ALIGN) * _ALIGN for p in params]
    weights = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    offset = 0
    with torch.no_grad():
        for param, size in zip(params, sizes, strict=True):
            view = weights[offset : offset + nbytes(param)].view(param.dtype).view(param.shape)
            view.copy_(param)
            param.data = view
            offset += size
    return weights


class TransformersEngine(EngineDefaults):
    """Implements `orchestrator.protocols.RolloutEngine` on an HF causal LM, with no hub download.

    `model` is the trainer's GPT (a `ModelShape`, `TinyGPTConfig` or `GPTConfig`, by `hf_config`) or a
    transformers config. A plain constructor, for Ray. Its first weights are throwaway: it serves
    nothing until a complete `update_weights`. `max_len` bounds prompt + completion (default: the config's)."""

    features = EngineFeatures(footprint=True, reports_weights=True)

    def __init__(
        self,
        model: ModelShape | TinyGPTConfig | GPTConfig | PretrainedConfig,
        *,
        max_batch: int = 64,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        name: str = "transformers",
    ) -> None:
        self.name = name
        self.config = model if isinstance(model, PretrainedConfig) else hf_config(model)
        self.device = torch.device(device) if device is not None else _default_device()
        self.model = _build_model(self.config, self.device)
        self.max_batch = max_batch
        self.max_len = max_len if max_len is not None else self.config.max_position_embeddings
        live = live_tensors(self.model)
        self._weights = _one_storage(live.values(), self.device)
        self._slots = CheckpointSlots(self.model, live)
        self._params = self._slots.views  # checkpoint name → where it loads
        self._weights_bytes = nbytes(self._weights)
        self._slab = kv_slab(self.model, max_batch, self.max_len)
        self._kv = self._slab.storage  # every layer's cache is a view of it
        self._kv_bytes = nbytes(self._kv)
        self._released: set[EngineMemory] = set()
        self._storage = {EngineMemory.WEIGHTS: self._weights, EngineMemory.KV_CACHE: self._kv}  # cuda_graph: none
        self._version: int | None = None
        self._loading: int | None = None  # the version a sync in progress is loading
        self._missing = set(self._slots.names)  # not loaded since the weights were (re)allocated
        self._sent_dtype: dict[str, torch.dtype] = {}  # `_note_dtypes`
        self._in_flight = 0
        self.cache_stale = False  # weights changed since the last flush_cache
        if self.device.type == "cpu":
            return_large_frees_to_the_os()  # else a freed storage stays in glibc's heap (storage.py)

    # ---- the RolloutEngine Protocol --------------------------------------------------------

    def release(self, tags: frozenset[EngineMemory]) -> None:
        """Refused while busy, before any effect; a tag is released once its storage is freed."""
        self._require_idle("release")
        if tags & self._released:
            note_noop(self.name, "release", f"{', '.join(sorted(tags & self._released))} already released")
        for tag in sorted(tags - self._released, reverse=True):  # weights, kv_cache, cuda_graph
            if tag in self._storage:
                self._storage[tag].untyped_storage().resize_(0)  # every param is a view of the weights
            if tag == EngineMemory.WEIGHTS:
                self._missing, self._loading = set(self._slots.names), None
            self._released.add(tag)
        _return_freed_pages(self.device)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        """A tag is resident once its storage is back (a resume may raise midway: out of memory)."""
        if tags - self._released:
            note_noop(self.name, "resume", f"{', '.join(sorted(tags - self._released))} not released")
        for tag in sorted(tags & self._released, reverse=True):
            if tag in self._storage:
                self._storage[tag].untyped_storage().resize_(self.footprint()[tag])
            self._released.discard(tag)
            if tag == EngineMemory.KV_CACHE:  # fresh pages may hold NaN bits, and a masked slot adds 0 · NaN
                self._kv.zero_()

    def released(self) -> frozenset[EngineMemory]:
        return frozenset(self._released)

    def flush_cache(self) -> None:
        """Zero the KV slab (each `generate` starts from an empty cache: no K/V of older weights stays)."""
        self._require_idle("flush_cache")
        if EngineMemory.KV_CACHE not in self._released:
            self._kv.zero_()
        self.cache_stale = False

    def weight_version(self) -> int | None:
        return self._version

    def is_idle(self) -> bool:
        return self._in_flight == 0

    # ---- weights ---------------------------------------------------------------------------

    def update_weights(self, named: Sequence[tuple[str, torch.Tensor]], version: int) -> int:
        """Copy one bucket of HF-named tensors into the params; returns the bytes written.

        Raises EngineError while the weights are released or a request is in flight, and
        ValueError, naming them, for unknown names or wrong shapes (before copying anything).
        Tensors are cast to the engine's dtype, as SGLang's loader does.
        """
        self._require_idle("update_weights")
        if EngineMemory.WEIGHTS in self._released:
            raise EngineError(self.name, "update_weights while the weights are released: resume them first")
        views = self._params
        _check_bucket(self.name, named, views)
        if self._loading != version:
            self._loading, self._missing = version, set(self._slots.names)
        _copy([views[name] for name, _ in named], [tensor for _, tensor in named])
        _note_dtypes(self._sent_dtype, named, views)
        written = sum(nbytes(views[name]) for name, _ in named)
        self._missing.difference_update(self._slots.slot[name] for name, _ in named)
        self.cache_stale = True
        if not self._missing:
            self._version, self._loading = version, None
        return written

    def missing_weights(self) -> frozenset[str]:
        """Checkpoint names not loaded since the weights were allocated or a new version began."""
        return frozenset(self._missing)

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of what it serves, as a checkpoint: each checkpoint name once (of tied names, the
        model's own first), as `save_pretrained` would un-fuse it."""
        if EngineMemory.WEIGHTS in self._released:
            raise EngineError(self.name, "the weights are released")
        return {name: self._params[name].clone() for name in self._slots.names}

    def digests(self) -> dict[str, str]:
        """SHA256 per checkpoint tensor (as `weights`) as it was sent (`_digests_as_sent`), to
        compare with the trainer's converted ones."""
        if EngineMemory.WEIGHTS in self._released:
            raise EngineError(self.name, "digests of released weights would prove nothing")
        return _digests_as_sent({name: self._params[name] for name in self._slots.names}, self._sent_dtype)

    def footprint(self) -> dict[EngineMemory, int]:
        """Bytes each tag takes while resident, from the engine's settings (released or not)."""
        weights, kv = self._weights_bytes, self._kv_bytes
        return {EngineMemory.WEIGHTS: weights, EngineMemory.KV_CACHE: kv, EngineMemory.CUDA_GRAPH: 0}

    def resident_bytes(self) -> dict[EngineMemory, int]:
        """Bytes each tag holds now: its footprint, 0 while released."""
        return {tag: 0 if tag in self._released else n for tag, n in self.footprint().items()}

    # ---- serving ---------------------------------------------------------------------------

    def generate(
        self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `max_new_tokens` tokens after each prompt row; no stop tokens, no padding.

        `prompts` is [B, P] int64 with B <= max_batch and P + max_new_tokens <= max_len.
        Returns (completions [B, N] int64, logprobs [B, N] float32) where logprobs[b, t] is
        log softmax(logits / temperature) of the chosen token: the log-probability of the
        distribution it was sampled from. At temperature 1 that is the policy log-prob a GRPO
        loss needs; at any other temperature it is not (recompute it at T = 1). Greedy decoding
        is not offered (temperature must be > 0). The same seed and weights give the same output.
        """
        problems = prompt_problems(
            prompts, max_new_tokens, temperature, self.max_batch, self.max_len, self.config.vocab_size
        )
        if problems:
            raise ValueError(f"engine {self.name}: " + "; ".join(problems))
        self._require_servable("generate", needs_kv=True)
        self._in_flight += 1
        try:
            return decode(
                self.model,
                self._slab,
                prompts,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=seed,
                device=self.device,
            )
        finally:
            self._in_flight -= 1

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, S, vocab] float32 of `tokens` [B, S], without the KV slab
        (and without a cache of the call's own: nothing is decoded after it)."""
        self._require_servable("logits", needs_kv=False)
        self._in_flight += 1
        try:
            with torch.no_grad():
                return self.model(input_ids=tokens.to(self.device), use_cache=False).logits.float()
        finally:
            self._in_flight -= 1

    def _require_servable(self, call: str, *, needs_kv: bool) -> None:
        reasons = []
        if EngineMemory.WEIGHTS in self._released:
            reasons.append("the weights are released")
        elif self._version is None and self._loading is None:
            reasons.append("no weight sync yet: it would serve random weights")
        elif self._missing:
            since = "since the weights were reallocated" if self._loading is None else f"by sync {self._loading}"
            example = sorted(self._missing)[0]
            reasons.append(f"{len(self._missing)} weight(s) not loaded {since} (e.g. {example})")
        if needs_kv and EngineMemory.KV_CACHE in self._released:
            reasons.append("the KV cache is released")
        if reasons:
            raise EngineError(self.name, f"{call} refused: " + "; ".join(reasons))

    def _require_idle(self, call: str) -> None:
        if self._in_flight:
            raise EngineError(self.name, f"{call} while {self._in_flight} request(s) are in flight")
