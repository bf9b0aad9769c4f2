"""TransformersEngine loads checkpoint tensors where transformers' own `from_pretrained` puts them,
for the families whose classes fuse or rename what they load (tiny random models, CPU, no download).

The checkpoint is what `save_pretrained` writes for a random model of the class: the names and
layouts transformers itself reads. Sent to the engine one tensor a bucket, in reverse order (no
fused param is whole until its last part arrives), it must leave the engine's model equal, bit for
bit, to the one `from_pretrained` loads from the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from orchestrator.adapters.engines.transformers import TransformersEngine

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=16,
    dtype=torch.bfloat16,
)


def _configs() -> dict[str, object]:
    import transformers

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16)
    return {
        "qwen3 tied": transformers.Qwen3Config(**SMALL, tie_word_embeddings=True),
        "qwen3_moe": transformers.Qwen3MoeConfig(**SMALL, **moe, num_experts=4, mlp_only_layers=[0]),
        "mixtral": transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v3": transformers.DeepseekV3Config(
            # MLA expands its latent to every head: KV heads fewer than the heads would not run a token
            **{k: v for k, v in SMALL.items() if k not in ("head_dim", "num_key_value_heads")},
            **moe,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
    }


@pytest.fixture(params=list(_configs()))
def checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[object, Path]:
    from transformers import AutoModelForCausalLM

    config = _configs()[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape))  # no two experts, rows or biases alike
    model.save_pretrained(tmp_path)
    return config, tmp_path


def test_the_engine_loads_each_checkpoint_tensor_where_from_pretrained_does(checkpoint: tuple[object, Path]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config, folder = checkpoint
    files = load_file(folder / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    engine = TransformersEngine(config, max_batch=1, max_len=8)
    assert type(engine.model) is type(reference)
    for name, tensor in reversed(list(files.items())):
        assert engine.weight_version() is None
        engine.update_weights([(name, tensor)], version=1)
    assert engine.weight_version() == 1 and not engine.missing_weights()
    expected = reference.state_dict()
    loaded = engine.model.state_dict()
    assert sorted(loaded) == sorted(expected)
    unequal = [n for n in expected if not torch.equal(loaded[n], expected[n])]
    assert not unequal, unequal
    assert sorted(engine.weights()) == sorted(files), "it serves back the checkpoint it was sent"
    assert all(torch.equal(engine.weights()[n], files[n].to(engine.weights()[n].dtype)) for n in files)
