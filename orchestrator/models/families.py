"""The HF families a Megatron-core GPT converts to, and what each was checked at.

One table (`SUPPORT`) answers "can colocate sync this model?" everywhere it is asked: the README,
`colocate plan --help`, and the converter's refusals, which name the families it knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["SUPPORT", "Family", "Support", "support_markdown", "support_table"]


class Family(StrEnum):
    """An HF model family, by its `model_type`."""

    LLAMA = "llama"
    QWEN3 = "qwen3"
    QWEN3_MOE = "qwen3_moe"
    MIXTRAL = "mixtral"
    DEEPSEEK_V3 = "deepseek_v3"
    GLM4_MOE = "glm4_moe"
    GLM_MOE_DSA = "glm_moe_dsa"


@dataclass(frozen=True)
class Support:
    """What the converter does for one family: the transformers class an engine loads, what it
    adds over Llama, and the layouts a test syncs it at into that class and checks its logits."""

    family: Family
    hf_class: str
    adds: str
    layouts: tuple[str, ...]  # checked: "TP", "PP", "EP", "expert TP"


SUPPORT: tuple[Support, ...] = (
    Support(Family.LLAMA, "LlamaForCausalLM", "", ("TP", "PP", "EP")),
    Support(Family.QWEN3, "Qwen3ForCausalLM", "q/k norm; tied embeddings too", ("TP", "PP", "EP")),
    Support(Family.QWEN3_MOE, "Qwen3MoeForCausalLM", "softmax-routed experts", ("TP", "PP", "EP", "expert TP")),
    Support(
        Family.MIXTRAL,
        "MixtralForCausalLM",
        "softmax-routed experts in every layer (SequentialMLP or GroupedMLP)",
        ("TP", "PP", "EP", "expert TP"),
    ),
    Support(
        Family.DEEPSEEK_V3,
        "DeepseekV3ForCausalLM",
        "MLA with YaRN; sigmoid-routed experts with a selection bias, groups, a scale, shared experts; first layers dense",
        ("TP", "PP", "EP", "expert TP"),
    ),
    Support(
        Family.GLM4_MOE,
        "Glm4MoeForCausalLM",
        "q/k/v biases, partial rotary, optional q/k norm; DeepSeek-V3's experts",
        ("TP", "PP", "EP", "expert TP"),
    ),
    Support(
        Family.GLM_MOE_DSA,
        "GlmMoeDsaForCausalLM",
        "DeepSeek-V3's MLA and experts with a DSA indexer (sparse attention); MTP layers on request",
        ("TP", "PP", "EP", "expert TP"),
    ),
)


def support_table() -> str:
    """`SUPPORT` as one line per family, for help texts and error messages."""
    return "\n".join(
        f"{s.family.value} ({s.hf_class}{': ' + s.adds if s.adds else ''}) at {', '.join(s.layouts)}" for s in SUPPORT
    )


def support_markdown() -> str:
    """`SUPPORT` as the Markdown table the README carries (a docs test keeps them equal)."""
    rows = [
        "| family | transformers class | beyond Llama | synced and checked at |",
        "| --- | --- | --- | --- |",
    ]
    rows += [f"| `{s.family.value}` | `{s.hf_class}` | {s.adds or '—'} | {', '.join(s.layouts)} |" for s in SUPPORT]
    return "\n".join(rows)
