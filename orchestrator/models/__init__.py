"""Model architectures as plain data, read by both the planner and the converter.

- `Family` and `SUPPORT` (`families`): the HF families colocate converts a Megatron GPT to, and
  the parallelisms each was checked at. The README, `colocate plan --help` and the converter's
  refusals all print this one table.

Pure Python: no torch, no transformers.
"""

from orchestrator.models.families import SUPPORT, Family, Support, support_markdown, support_table

__all__ = ["SUPPORT", "Family", "Support", "support_markdown", "support_table"]
