"""TransformersEngine against the RolloutEngine contract, on a tiny random Llama (CPU, no download)."""

from __future__ import annotations

import pytest
import structlog
import torch

pytest.importorskip("transformers")

from orchestrator.adapters.digest import sha256_digests
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.convert import hf_llama_config, hf_names
from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.errors import EngineError
from orchestrator.protocols import RolloutEngine
from states import EngineMemory
from tests.support.rounding import SIGMAS, U

WEIGHTS, KV, GRAPH = EngineMemory.WEIGHTS, EngineMemory.KV_CACHE, EngineMemory.CUDA_GRAPH


SHAPE = TinyGPTConfig()


def random_weights(engine: TransformersEngine, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Weights scaled so activations are O(1): a wrong load changes the output visibly."""
    generator = torch.Generator().manual_seed(seed)
    weights = []
    for name, param in engine.model.named_parameters():
        values = torch.randn(param.shape, generator=generator)
        values = 1 + 0.2 * values if param.dim() == 1 else values / param.shape[-1] ** 0.5
        weights.append((name, values.to(param.dtype)))
    return weights


def prompts(batch: int = 8, length: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SHAPE.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def engine() -> TransformersEngine:
    return TransformersEngine(SHAPE, max_batch=16)


@pytest.fixture
def synced(engine: TransformersEngine) -> TransformersEngine:
    engine.update_weights(random_weights(engine), version=1)
    engine.flush_cache()
    return engine


def param_storage_bytes(engine: TransformersEngine) -> dict[int, int]:
    """Bytes of each distinct storage behind the params (the engine keeps them all in one)."""
    return {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in engine.model.parameters()}


def test_implements_the_protocol_and_names_match_the_conversion(engine: TransformersEngine) -> None:
    assert isinstance(engine, RolloutEngine)
    assert [name for name, _ in engine.model.named_parameters()] == hf_names(SHAPE)
    assert engine.is_idle() and engine.weight_version() is None


def test_generate_is_refused_before_the_first_sync(engine: TransformersEngine) -> None:
    with pytest.raises(EngineError, match="no weight sync yet"):
        engine.generate(prompts(), max_new_tokens=4, temperature=1.0, seed=0)


def test_version_is_served_only_once_every_bucket_arrived(engine: TransformersEngine) -> None:
    weights = random_weights(engine)
    half = len(weights) // 2
    written = engine.update_weights(weights[:half], version=1)
    assert written == sum(t.numel() * t.element_size() for _, t in weights[:half])
    assert engine.weight_version() is None and len(engine.missing_weights()) == len(weights) - half
    engine.update_weights(weights[half:], version=1)
    assert engine.weight_version() == 1 and not engine.missing_weights()
    engine.update_weights(weights[:half], version=2)
    assert engine.weight_version() == 1, "version 2 is incomplete"
    with pytest.raises(EngineError, match=f"{len(weights) - half} weight\\(s\\) not loaded by sync 2"):
        engine.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)


def test_loaded_weights_have_the_digests_of_what_was_sent(engine: TransformersEngine) -> None:
    weights = random_weights(engine)
    engine.update_weights(weights, version=1)
    assert engine.digests() == sha256_digests(dict(weights))


def test_unknown_name_or_wrong_shape_is_refused_before_anything_is_copied(synced: TransformersEngine) -> None:
    before = synced.digests()
    good = random_weights(synced, seed=5)[0]
    with pytest.raises(ValueError, match=r"unknown weight name\(s\): model\.layers\.9\.mlp\.up_proj\.weight"):
        synced.update_weights([good, ("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], version=2)
    with pytest.raises(ValueError, match=r"wrong shape\(s\): lm_head\.weight"):
        synced.update_weights([good, ("lm_head.weight", torch.zeros(3, 3))], version=2)
    assert synced.digests() == before
    assert synced.weight_version() == 1


def test_release_weights_frees_their_storages_and_resume_reallocates(synced: TransformersEngine) -> None:
    held = param_storage_bytes(synced)
    assert len(held) == 1, "one storage behind every weight: one allocation to release and take back"
    total = sum(held.values())
    assert total >= sum(p.numel() * p.element_size() for p in synced.model.parameters())
    assert synced.resident_bytes()[WEIGHTS] == total
    synced.release(frozenset({WEIGHTS}))
    assert list(param_storage_bytes(synced).values()) == [0]
    assert synced.resident_bytes()[WEIGHTS] == 0
    with pytest.raises(EngineError, match="weights are released"):
        synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)
    with pytest.raises(EngineError, match="released"):
        synced.update_weights(random_weights(synced), version=2)
    synced.resume(frozenset({WEIGHTS}))
    assert param_storage_bytes(synced) == held
    assert synced.weight_version() == 1, "like SGLang, the version survives a release"
    with pytest.raises(EngineError, match="not loaded since the weights were reallocated"):
        synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)
    synced.update_weights(random_weights(synced), version=2)
    synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)


def test_release_kv_frees_the_slab_and_resume_gives_it_back_zeroed(synced: TransformersEngine) -> None:
    held = synced.resident_bytes()[KV]
    # 2 (k, v) x 2 layers x 16 rows x 2 kv heads x 32 positions x 16 dims, bf16
    assert held == 2 * 2 * 16 * 2 * 32 * 16 * 2
    synced.release(frozenset({KV}))
    assert synced.resident_bytes() == {WEIGHTS: synced.resident_bytes()[WEIGHTS], KV: 0, GRAPH: 0}
    with pytest.raises(EngineError, match="KV cache is released"):
        synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)
    synced.logits(prompts())  # teacher forcing needs no KV slab
    synced.resume(frozenset({KV}))
    assert synced.resident_bytes()[KV] == held
    assert not synced._kv.any()
    synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)


def test_cuda_graph_is_accepted_and_recorded_and_a_repeat_is_a_noop_with_a_note(synced: TransformersEngine) -> None:
    synced.release(frozenset({GRAPH}))
    assert synced.released() == {GRAPH}
    with structlog.testing.capture_logs() as logs:
        synced.release(frozenset({GRAPH, KV}))  # graph: a no-op; kv: released
    assert synced.released() == {GRAPH, KV} and synced.resident_bytes()[KV] == 0
    assert [(e["call"], e["why"]) for e in logs if e["event"] == "noop"] == [("release", "cuda_graph already released")]
    synced.resume(frozenset({GRAPH, KV}))
    with structlog.testing.capture_logs() as logs:
        synced.resume(frozenset({GRAPH}))
    assert [(e["call"], e["why"]) for e in logs if e["event"] == "noop"] == [("resume", "cuda_graph not released")]
    assert synced.released() == frozenset()
    synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)


class _FailingStorage:
    """A KV slab whose storage cannot be resized: a release or resume that raises midway."""

    def untyped_storage(self) -> _FailingStorage:
        return self

    def resize_(self, nbytes: int) -> None:
        raise RuntimeError("the allocator failed")


def test_a_release_or_resume_that_raises_midway_reports_what_it_did(synced: TransformersEngine) -> None:
    """The weights are freed before the KV slab: a failure at the slab leaves them released."""
    kv = synced._kv
    synced._storage[KV] = _FailingStorage()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="the allocator failed"):
        synced.release(frozenset({WEIGHTS, KV}))
    assert synced.released() == {WEIGHTS}
    assert synced.resident_bytes()[WEIGHTS] == 0
    synced._storage[KV] = kv
    synced.release(frozenset({WEIGHTS, KV}))  # weights: a no-op now
    assert synced.released() == {WEIGHTS, KV}
    synced._storage[KV] = _FailingStorage()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="the allocator failed"):
        synced.resume(frozenset({WEIGHTS, KV}))
    assert synced.released() == {KV}, "the weights came back, the slab did not"
    synced._storage[KV] = kv
    synced.resume(frozenset({KV}))
    assert synced.released() == frozenset()


def test_release_while_busy_is_refused_before_anything_is_freed(synced: TransformersEngine) -> None:
    refused: list[Exception] = []

    def hook(*_: object) -> None:
        handle.remove()
        try:
            synced.release(frozenset({WEIGHTS, KV}))
        except EngineError as exc:
            refused.append(exc)

    handle = synced.model.register_forward_pre_hook(hook)
    synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)
    assert len(refused) == 1 and "in flight" in str(refused[0])
    assert synced.released() == frozenset() and synced.resident_bytes()[WEIGHTS] > 0


def test_flush_zeroes_the_slab_and_clears_staleness(synced: TransformersEngine) -> None:
    synced.generate(prompts(), max_new_tokens=4, temperature=1.0, seed=0)
    assert synced._kv.any()
    synced.update_weights(random_weights(synced, seed=3), version=2)
    assert synced.cache_stale
    synced.flush_cache()
    assert not synced.cache_stale and not synced._kv.any()


def test_generate_is_deterministic_given_the_seed(synced: TransformersEngine) -> None:
    first = synced.generate(prompts(), max_new_tokens=6, temperature=1.0, seed=7)
    again = synced.generate(prompts(), max_new_tokens=6, temperature=1.0, seed=7)
    other = synced.generate(prompts(), max_new_tokens=6, temperature=1.0, seed=8)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    assert first[0].dtype == torch.int64 and first[1].dtype == torch.float32
    assert first[0].shape == first[1].shape == (8, 6)


# The rounding model of tests/support/rounding.py (U, SIGMAS). The bf16 roundings on a logit's path
# in this Llama, per layer: each RMSNorm's two (the normalised value cast to bf16, then times its weight), q and k (the linear, then RoPE's two
# products and their sum: 4 each), v, the attention's output, o_proj, the residual sum, gate, up,
# SiLU, gate x up, down and the residual sum: 22; two layers, the final norm's 2 and the lm_head's.
LOGIT_ROUNDINGS = 2 * 22 + 2 + 1


def bf16_logprob_tolerance(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[batch, seq]: how far a bf16 decode's log-probs may be from the log softmax of teacher-forced
    `logits` [batch, seq, vocab] at `temperature`.

    Both paths run the same bf16 arithmetic on the same inputs, with kernels of other shapes (a GEMM
    of one row against one of S rows, attention over the cache against a causal mask), so any of
    the LOGIT_ROUNDINGS may come out otherwise. Counted as independent on the two sides, a logit
    z_j = w_j . h differs by a standard deviation of sqrt(2 N / 3) U s_j (N roundings, each side's
    variance U²/3, relative to s_j = sqrt(sum_i w_ji² h_i²), which for random weights is the
    token's rms logit): 5.6 U rms(z) = 2.2% of it. log_softmax(z / T)_i = z_i / T - logsumexp(z / T)
    moves by at most twice the largest logit difference over T (logsumexp's gradient is the
    softmax, whose weights sum to 1). So: 2 x SIGMAS x 5.6 U rms(z) / T = 0.26 rms(z) / T; here
    rms(z) is about 1, so 0.23-0.29 at T = 1 and 0.32-0.41 at T = 0.7. Measured (4 weight seeds):
    at most 0.021 apart with AVX2 kernels (an AMD EPYC; an AMX Xeon forced to AVX2 alike), 0.022
    with AVX-512/AMX ones (that Xeon): under a tenth of the bound. A wrong log-prob is far outside
    it: another token's moves it by the logits' spread, one read a position early by about 10 x
    the bound, decode positions that stall or skip by 3-12 x, log-probs at T = 1 for a sample at
    T = 0.7 by about 2 x (the test checks the early read and the temperature)."""
    spread = (2 * LOGIT_ROUNDINGS / 3) ** 0.5 * U * logits.float().square().mean(-1).sqrt()
    return 2 * SIGMAS * spread / temperature


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits / temperature, dim=-1).gather(2, tokens[..., None]).squeeze(2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprobs_are_those_of_the_sampling_distribution(temperature: float, dtype: torch.dtype) -> None:
    """The KV-cached decode agrees with a teacher-forced forward over prompt + completion: to
    fp32 rounding in fp32; in bf16 to the two paths' kernels' rounding (`bf16_logprob_tolerance`)."""
    config = hf_llama_config(SHAPE)
    config.dtype = dtype
    engine = TransformersEngine(config, max_batch=16)
    engine.update_weights(random_weights(engine), version=1)
    batch = prompts(batch=5)
    completions, logprobs = engine.generate(batch, max_new_tokens=6, temperature=temperature, seed=0)
    forced = engine.logits(torch.cat([batch, completions], dim=1))
    logits = forced[:, batch.shape[1] - 1 : -1]
    expected = chosen_logprobs(logits, completions, temperature)
    assert (logprobs < 0).all()
    if dtype == torch.float32:
        torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)
        return
    bound = bf16_logprob_tolerance(logits, temperature)
    apart = (logprobs - expected).abs()
    assert (apart <= bound).all(), f"{(apart / bound).max():.2f} x the bound; {apart.max():.3f} apart"
    # The bound is no wider than the mistakes this test exists for: a log-prob read one position
    # early, and one at T = 1 for a token sampled at T = 0.7, are outside it.
    early = chosen_logprobs(forced[:, batch.shape[1] - 2 : -2], completions, temperature)
    assert ((logprobs - early).abs() > bound).any()
    if temperature != 1.0:
        assert ((logprobs - chosen_logprobs(logits, completions, 1.0)).abs() > bound).any()


def test_arguments_are_checked(synced: TransformersEngine) -> None:
    for bad, match in [
        (dict(prompts=prompts(batch=17)), "exceeds max_batch 16"),
        (dict(prompts=prompts(length=30)), "exceed max_len 32"),
        (dict(prompts=prompts().int()), "int64"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(prompts=prompts() + SHAPE.vocab_size), "token ids outside"),
    ]:
        call = {"prompts": prompts(), "max_new_tokens": 4, "temperature": 1.0, "seed": 0, **bad}
        with pytest.raises(ValueError, match=match):
            synced.generate(**call)  # type: ignore[arg-type]


def test_busy_while_generating_and_release_is_refused_then(synced: TransformersEngine) -> None:
    seen: list[bool] = []
    refusals: list[str] = []

    def during_forward(*_: object) -> None:
        seen.append(synced.is_idle())
        try:
            synced.release(frozenset({KV}))
        except EngineError as error:
            refusals.append(str(error))

    handle = synced.model.register_forward_pre_hook(during_forward)
    try:
        synced.generate(prompts(), max_new_tokens=2, temperature=1.0, seed=0)
    finally:
        handle.remove()
    assert seen == [False, False]
    assert len(refusals) == 2 and "in flight" in refusals[0]
    assert synced.is_idle() and synced.resident_bytes()[KV] > 0


def test_a_weight_sent_in_bf16_into_an_fp32_param_is_digested_as_sent_and_a_changed_value_is_seen() -> None:
    """HF keeps DeepSeek-V3's router weight in fp32 (`_keep_in_fp32_modules_strict`); Megatron's is
    bf16. The engine's digest of it is the bf16 one the trainer computed, as long as the param holds
    exactly the sent values; one value that no bf16 holds makes it differ."""
    from tests.support.family_shapes import SHAPES

    engine = TransformersEngine(SHAPES["deepseek_v3"], max_batch=2)
    router = next(n for n in engine.weights() if n.endswith("mlp.gate.weight"))
    assert engine.weights()[router].dtype == torch.float32
    generator = torch.Generator().manual_seed(0)
    sent = [(n, torch.randn(t.shape, generator=generator).to(torch.bfloat16)) for n, t in engine.weights().items()]
    engine.update_weights(sent, version=1)
    assert engine.digests() == sha256_digests(dict(sent))

    with torch.no_grad():  # 1 + 2**-10 is fp32, and between two bf16 values (their spacing at 1 is 2**-7)
        engine.model.get_parameter(router).view(-1)[0] = 1 + 2**-10
    digests = engine.digests()
    assert digests[router] != sha256_digests(dict(sent))[router]
    assert {n for n in digests if digests[n] != sha256_digests(dict(sent))[n]} == {router}
