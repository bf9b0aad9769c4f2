"""Model shapes as plain data, read by the planner, the converter and the builder alike.

- `Family` and `SUPPORT` (`families`): the HF families colocate converts a Megatron GPT to, and
  the parallelisms each was checked at. The README, `colocate plan --help` and the converter's
  refusals all print this one table.
- `ModelShape` (`shape`): a decoder-only model's shape, the one type every user reads.
- `read_config` (`config`): the one reader of HF model configs, to a `ModelShape`; what a config
  leaves to its `model_type` is in `hf_types`.

Pure Python: no torch, no transformers.
"""

from orchestrator.models.config import read_config
from orchestrator.models.families import SUPPORT, Family, Support, support_markdown, support_table
from orchestrator.models.shape import MEGATRON_LAYERNORM_EPS, ModelShape

__all__ = [
    "MEGATRON_LAYERNORM_EPS",
    "SUPPORT",
    "Family",
    "ModelShape",
    "Support",
    "read_config",
    "support_markdown",
    "support_table",
]
