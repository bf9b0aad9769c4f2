"""One gloo rank of a tensor-parallel MLA GPT built with Megatron's local layer spec, for the
planner's `--spec local` check: each rank writes `{param name: numel}`.

Megatron-core 0.16.1 cannot build MLA with the local spec as it ships on a CPU host, so two seams
are replaced, neither holding a parameter:
- the local `DotProductAttention` does not take the `k_channels`/`v_channels` MLA passes it: a
  subclass drops them;
- `MLASelfAttention` asks `isinstance(linear_proj, TELinear)`, and without Transformer Engine
  Megatron's stand-in for `TELinear` is a MagicMock: a class no module is an instance of stands in.
Everything with parameters (the column-parallel down and up projections, the norms, the MLP) is
Megatron's own, from `get_gpt_layer_local_spec(multi_latent_attention=True)`.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Small MLA: q LoRA and kv LoRA with their norms, as DeepSeek-V3 has them.
SHAPE: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=8,
)
VOCAB = 256


def rank(r: int, world: int, port: int, out: str) -> None:
    try:
        result = {"params": _params(r, world, port)}
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out, f"rank{r}.json").write_text(json.dumps(result))


def _params(r: int, world: int, port: int) -> dict[str, int]:
    import megatron.core.transformer.multi_latent_attention as mla
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from orchestrator.adapters.megatron.build import UNFUSED
    from orchestrator.adapters.megatron.cpu import enable_cpu_path

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kw: Any):
            super().__init__(*args, **kw)

    enable_cpu_path()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1)
    if not isinstance(mla.TELinear, type):
        mla.TELinear = type("NoTransformerEngine", (), {})
    config = MLATransformerConfig(
        **SHAPE,
        qk_layernorm=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        rope_type="rope",
        use_cpu_initialization=True,
        tensor_model_parallel_size=world,
        **UNFUSED,
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=32,
        position_embedding_type="rope",
    )
    return {name: p.numel() for name, p in gpt.named_parameters()}
