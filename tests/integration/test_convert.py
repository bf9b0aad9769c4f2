"""Megatron-core GPT → HF: the name and shape rules of each family (fast), then the real thing (slow): a
megatron-core GPT at world size 1 in a spawned gloo process, its params converted and loaded into
`TransformersEngine`, whose logits must match Megatron's within bf16 tolerance, while each classic
mapping mistake must not.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from orchestrator.adapters.digest import sha256_digests
from orchestrator.adapters.engines.transformers import TransformersEngine
from orchestrator.adapters.megatron.convert import (
    Family,
    convert,
    family_of,
    hf_buckets,
    hf_config,
    hf_llama_config,
    hf_names,
    to_hf,
)
from orchestrator.adapters.megatron.convert.spec import checked
from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.models import ModelShape

# GQA with 4 heads per group (so a split that ignores the grouping moves heads), and a theta
# other than HF's default (so a theta that is not passed through shows).
GQA = TinyGPTConfig(
    hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=256, vocab_size=256, rotary_base=500000
)


def megatron_names(shape: TinyGPTConfig) -> list[str]:
    """The names `MegatronTrainer.sync_tensors` yields for a dense local-spec GPT."""
    per_layer = (
        "input_layernorm.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    )
    layers = [f"decoder.layers.{i}.{p}" for i in range(shape.num_layers) for p in per_layer]
    return ["embedding.word_embeddings.weight", *layers, "decoder.final_layernorm.weight", "output_layer.weight"]


def megatron_shape(name: str, shape: TinyGPTConfig) -> tuple[int, ...]:
    h, hd = shape.hidden_size, shape.hidden_size // shape.num_attention_heads
    rows = {
        "linear_qkv": (shape.num_attention_heads + 2 * shape.num_query_groups) * hd,
        "linear_proj": h,
        "linear_fc1": 2 * shape.ffn_hidden_size,
        "linear_fc2": h,
        "word_embeddings": shape.vocab_size,
        "output_layer": shape.vocab_size,
    }
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if module not in rows:
        return (h,)
    cols = shape.ffn_hidden_size if module == "linear_fc2" else h
    return (rows[module], cols)


# ---- the rules, no Megatron needed ------------------------------------------------------------


def test_llama_config_computes_what_megatron_computes() -> None:
    config = hf_llama_config(GQA)
    assert config.rms_norm_eps == 1e-5, "Megatron's layernorm_epsilon, not HF's 1e-6"
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 16)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (256, 256, 32)
    assert config.tie_word_embeddings is False and config.attention_bias is False and config.mlp_bias is False
    assert config.dtype == torch.bfloat16 and config._attn_implementation == "sdpa"


def test_moe_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="num_experts=2"):
        hf_llama_config(TinyGPTConfig(num_experts=2))


def test_a_full_sync_covers_exactly_the_hf_names() -> None:
    named = [(n, torch.zeros(megatron_shape(n, GQA), dtype=torch.bfloat16)) for n in megatron_names(GQA)]
    converted = dict(convert(named, GQA))
    assert sorted(converted) == sorted(hf_names(GQA))
    engine = TransformersEngine(GQA, max_batch=1)
    assert [n for n, _ in engine.model.named_parameters()] == hf_names(GQA)
    assert all(converted[n].shape == p.shape for n, p in engine.model.named_parameters())


def test_qkv_is_split_per_query_group() -> None:
    """Row r of linear_qkv holds r: each group is [4 q heads, 1 k head, 1 v head] of 16 rows."""
    hd, heads_per_group = 16, 4
    rows = torch.arange(GQA.hidden_size // hd * hd + 4 * hd, dtype=torch.float32)
    qkv = rows[:, None].expand(-1, GQA.hidden_size)
    (q_name, q), (_, k), (_, v) = to_hf("decoder.layers.1.self_attention.linear_qkv.weight", qkv, GQA)
    assert q_name == "model.layers.1.self_attn.q_proj.weight"
    group = (heads_per_group + 2) * hd
    assert q[:, 0].tolist() == [*range(0, 64), *range(group, group + 64)]
    assert k[:, 0].tolist() == [*range(64, 80), *range(group + 64, group + 80)]
    assert v[:, 0].tolist() == [*range(80, 96), *range(group + 80, group + 96)]


def test_fc1_is_gate_then_up() -> None:
    fc1 = torch.arange(2 * GQA.ffn_hidden_size, dtype=torch.float32)[:, None].expand(-1, GQA.hidden_size)
    (gate_name, gate), (up_name, up) = to_hf("decoder.layers.0.mlp.linear_fc1.weight", fc1, GQA)
    assert (gate_name, up_name) == ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert gate[0, 0] == 0 and up[0, 0] == GQA.ffn_hidden_size


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("decoder.layers.1.mlp.router.weight", "MoE"),
        ("decoder.layers.1.mlp.router.expert_bias", "MoE"),
        ("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", "MoE"),
        ("fp32_output_scale", "test-only"),
        ("decoder.layers.0.self_attention.q_layernorm.weight", "no mapping"),
        ("decoder.layers.2.mlp.linear_fc2.weight", "beyond num_layers=2"),
    ],
)
def test_unmappable_tensors_are_refused_by_name(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"{name!r}.*{why}"):
        to_hf(name, torch.zeros(4), GQA)


def test_a_shape_that_does_not_fit_the_config_is_refused() -> None:
    with pytest.raises(ValueError, match=r"linear_qkv.weight'.*shape \(128, 128\), expected \(192, 128\)"):
        to_hf("decoder.layers.0.self_attention.linear_qkv.weight", torch.zeros(128, 128), GQA)


def test_te_fused_norm_names_map_to_the_same_norms() -> None:
    norm = torch.ones(GQA.hidden_size)
    assert to_hf("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", norm, GQA)[0][0] == (
        "model.layers.0.input_layernorm.weight"
    )
    assert to_hf("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", norm, GQA)[0][0] == (
        "model.layers.0.post_attention_layernorm.weight"
    )


# ---- the families: Qwen3's q/k norm, Qwen3-MoE's router and experts ---------------------------------

MOE = checked(
    ModelShape(
        family=Family.QWEN3_MOE,
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=128,
        max_position_embeddings=32,
        rotary_base=500000.0,
        qk_layernorm=True,
        num_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_layers=(1,),
    )
)
QWEN3 = checked(ModelShape(**{**asdict(MOE), "family": Family.QWEN3, "num_experts": 0, "moe_layers": ()}))


@pytest.mark.parametrize("spec", [checked(GQA.shape()), QWEN3, MOE], ids=lambda s: s.family.value)
def test_hf_names_are_what_transformers_saves(spec: ModelShape, tmp_path: Path) -> None:
    """The checkpoint names an engine loads: transformers' own `save_pretrained` writes them
    (for Qwen3-MoE it un-fuses its experts into exactly these)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config(spec)).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert sorted(saved.keys()) == sorted(hf_names(spec))


def test_qk_norms_map_to_qwen3s() -> None:
    norm = torch.ones(16)
    for spec in (QWEN3, MOE):
        ((name, _),) = to_hf("decoder.layers.1.self_attention.k_layernorm.weight", norm, spec)
        assert name == "model.layers.1.self_attn.k_norm.weight"


def test_router_and_experts_map_to_qwen3_moes() -> None:
    fc1 = torch.arange(64, dtype=torch.float32)[:, None].expand(-1, 64)
    (gate_name, gate), (up_name, up) = to_hf("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", fc1, MOE)
    assert (gate_name, up_name) == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )
    assert gate[:, 0].tolist() == list(range(32)) and up[0, 0] == 32
    ((router, _),) = to_hf("decoder.layers.1.mlp.router.weight", torch.zeros(4, 64), MOE)
    assert router == "model.layers.1.mlp.gate.weight"
    ((down, _),) = to_hf("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", torch.zeros(64, 32), MOE)
    assert down == "model.layers.1.mlp.experts.0.down_proj.weight"


@pytest.mark.parametrize(
    ("name", "shape", "why"),
    [
        ("decoder.layers.1.mlp.router.expert_bias", (4,), "no expert bias"),
        (
            "decoder.layers.1.mlp.experts.local_experts.4.linear_fc2.weight",
            (64, 32),
            "expert 4 is beyond num_experts=4",
        ),
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", (64, 32), "layer 0 is a dense layer"),
        ("decoder.layers.1.mlp.linear_fc1.weight", (256, 64), "layer 1 is an MoE layer"),
    ],
)
def test_moe_tensors_out_of_place_are_refused_by_name(name: str, shape: tuple[int, ...], why: str) -> None:
    with pytest.raises(ValueError, match=f"{name!r}.*{why}"):
        to_hf(name, torch.zeros(shape), MOE)


@pytest.mark.parametrize(
    ("family", "change", "why"),
    [
        (Family.LLAMA, {"num_experts": 0, "moe_layers": ()}, "qk_layernorm .Llama has no q/k norm"),
        (Family.QWEN3, {"qk_layernorm": True}, "num_experts=4 .the qwen3 family is dense"),
        (Family.QWEN3_MOE, {"expert_bias": True}, "Qwen3-MoE's router has no expert bias"),
        (Family.QWEN3_MOE, {"qk_layernorm": False}, "no qk_layernorm"),
    ],
)
def test_a_model_the_family_cannot_compute_is_refused(family: Family, change: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=f"no HF {family.value} equivalent: .*{why}"):
        checked(ModelShape(**{**asdict(MOE), **change, "family": family}))


def test_model_spec_is_the_old_name_of_a_checked_shape() -> None:
    """docs/conversion.md documented `ModelSpec.from_megatron`: the name still builds a checked
    `ModelShape`, and refuses what the family cannot compute."""
    from orchestrator.adapters.megatron.convert import ModelSpec, shape_from_megatron

    assert ModelSpec(**asdict(MOE)) == MOE
    assert ModelSpec.from_tiny(GQA) == checked(GQA.shape())
    assert ModelSpec.from_megatron is shape_from_megatron
    with pytest.raises(ValueError, match="no HF llama equivalent: num_experts=4"):
        ModelSpec(**{**asdict(MOE), "family": Family.LLAMA, "qk_layernorm": False})


@pytest.mark.parametrize(
    ("experts", "qk_layernorm", "family"),
    [
        (None, False, Family.LLAMA),
        (0, False, Family.LLAMA),
        (None, True, Family.QWEN3),
        (8, True, Family.QWEN3_MOE),
        (8, False, Family.MIXTRAL),  # experts without a q/k norm: not converted as a Llama
    ],
)
def test_the_family_is_read_from_megatrons_config(experts: int | None, qk_layernorm: bool, family: Family) -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(num_moe_experts=experts, qk_layernorm=qk_layernorm, moe_router_score_function="softmax")
    assert family_of(config) is family


def test_a_bucket_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be positive, not 0"):
        next(hf_buckets([], family="llama", bucket_bytes=0))


# ---- the real Megatron GPT (slow) ---------------------------------------------------------------


def _megatron_rank(port: int, out: str) -> None:
    """World size 1 over gloo: build, give the params O(1) values, save sync tensors and logits."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    result: dict[str, Any]
    try:
        from orchestrator.adapters.megatron.build import (
            TinyGPTConfig,
            build_gpt,
            destroy_process_group,
            init_process_group,
        )
        from orchestrator.adapters.megatron.trainer import MegatronTrainer

        init_process_group(0, 1, port)
        cfg = TinyGPTConfig(**{f: getattr(GQA, f) for f in GQA.__dataclass_fields__})
        chunks, optimizer = build_gpt(cfg)
        sync = dict(MegatronTrainer(chunks, optimizer).sync_tensors())
        generator = torch.Generator().manual_seed(0)
        # Megatron's init (std 0.02, unit norms) leaves logits near 0, where a wrong mapping hides.
        with torch.no_grad():
            for name, tensor in sync.items():
                values = torch.randn(tensor.shape, generator=generator)
                scale = 1.0 if "word_embeddings" in name else tensor.shape[-1] ** -0.5
                tensor.copy_(1 + 0.2 * values if tensor.dim() == 1 else values * scale)
            tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=generator)
            positions = torch.arange(cfg.seq_len).expand_as(tokens)
            logits = chunks[0](tokens, positions, None)  # no labels: logits [b, s, vocab], fp32
        result = {"sync": {n: t.clone() for n, t in sync.items()}, "tokens": tokens, "logits": logits}
        destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, out)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    from tests.support.spawn import context, free_port

    out = tmp_path_factory.mktemp("convert") / "rank0.pt"
    process = context().Process(target=_megatron_rank, args=(free_port(), str(out)))
    process.start()
    process.join(240)
    if process.is_alive():
        process.kill()
        raise TimeoutError("the Megatron rank did not finish in 240 s")
    result: dict[str, Any] = torch.load(Path(out), weights_only=False)
    if "error" in result:
        raise RuntimeError("the Megatron rank failed:\n" + result["error"])
    return result


def _over(megatron: dict[str, Any], named: list[tuple[str, torch.Tensor]], **config: Any) -> torch.Tensor:
    """[batch, seq] each token's worst |Δlogit| over what the two sides' bf16 rounding through the
    layers can make (`rounding.logit_tolerance`), with the engine's config keys `config` set."""
    from tests.support.rounding import logit_spread, logit_tolerance

    hf_config = hf_llama_config(GQA)
    for key, value in config.items():
        setattr(hf_config, key, value)
    engine = TransformersEngine(hf_config, max_batch=8)
    engine.update_weights(named, version=1)
    with logit_spread(engine.model) as spreads:
        logits = engine.logits(megatron["tokens"]).cpu()
    tolerance = logit_tolerance(megatron["logits"], spreads[0], GQA.num_layers)
    return (logits - megatron["logits"]).abs().amax(-1) / tolerance


def _swap_gate_up(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    swap = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
    return [(_rename(n, swap), t) for n, t in named]


def _rename(name: str, swap: dict[str, str]) -> str:
    for old, new in swap.items():
        if f".{old}." in name:
            return name.replace(f".{old}.", f".{new}.")
    return name


def _qkv_split_ignoring_groups(megatron: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The classic bug: q, k, v as three contiguous blocks of the fused weight."""
    named = list(convert(megatron["sync"].items(), GQA))
    q_rows = GQA.hidden_size
    kv_rows = GQA.num_query_groups * GQA.hidden_size // GQA.num_attention_heads
    for i in range(GQA.num_layers):
        fused = megatron["sync"][f"decoder.layers.{i}.self_attention.linear_qkv.weight"]
        q, k, v = fused.split([q_rows, kv_rows, kv_rows])
        blocks = {f"model.layers.{i}.self_attn.{p}_proj.weight": t for p, t in zip("qkv", (q, k, v), strict=True)}
        named = [(n, blocks.get(n, t)) for n, t in named]
    return named


@pytest.mark.slow
def test_hf_logits_match_megatron_within_bf16_tolerance(megatron: dict[str, Any]) -> None:
    named = list(convert(megatron["sync"].items(), GQA))
    over = _over(megatron, named)
    assert megatron["logits"].abs().mean() > 0.3, "logits near 0 would hide a wrong mapping"
    assert over.max() <= 1, f"a token's |Δlogit| is {over.max():.2f} of its tolerance"


@pytest.mark.slow
def test_the_engine_holds_exactly_the_converted_tensors(megatron: dict[str, Any]) -> None:
    """What `engine_matches_trainer` compares: digests of the trainer's converted tensors."""
    named = list(convert(megatron["sync"].items(), GQA))
    engine = TransformersEngine(GQA, max_batch=8)
    engine.update_weights(named, version=3)
    assert engine.weight_version() == 3
    assert engine.digests() == sha256_digests(dict(named))


BREAKAGES: dict[str, Callable[[dict[str, Any]], torch.Tensor]] = {
    "gate/up swapped": lambda m: _over(m, _swap_gate_up(list(convert(m["sync"].items(), GQA)))),
    "qkv split ignoring groups": lambda m: _over(m, _qkv_split_ignoring_groups(m)),
    "theta not passed through": lambda m: _over(
        m, list(convert(m["sync"].items(), GQA)), rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_wrong_mapping_breaks_the_tolerance(megatron: dict[str, Any], breakage: str) -> None:
    """Otherwise the match above would prove nothing: each mistake moves a token past twice its
    tolerance."""
    over = BREAKAGES[breakage](megatron)
    print(f"\n{breakage}: the worst token at {over.max():.2f} of its tolerance")
    assert over.max() > 2, f"{breakage}: the worst token only {over.max():.2f} of its tolerance"
