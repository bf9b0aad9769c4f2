"""Model architectures as plain data, read by both the planner and the converter.

- `Family` and `SUPPORT` (`families`): the HF families colocate converts a Megatron GPT to, and
  the parallelisms each was checked at. The README, `colocate plan --help` and the converter's
  refusals all print this one table.
- `read_config` (`config`): the one reader of HF model configs, to an `Architecture`
  (`architecture`); what a config leaves to its `model_type` is in `hf_types`.

Pure Python: no torch, no transformers.
"""

from orchestrator.models.architecture import Architecture
from orchestrator.models.config import read_config
from orchestrator.models.families import SUPPORT, Family, Support, support_markdown, support_table

__all__ = ["SUPPORT", "Architecture", "Family", "Support", "read_config", "support_markdown", "support_table"]
