"""A directory of checkpoints, each complete only once renamed into place (`store`)."""

from orchestrator.adapters.checkpoints.store import (
    MANIFEST,
    CheckpointRefused,
    begin,
    complete,
    latest,
    seal,
    verify,
)

__all__ = ["MANIFEST", "CheckpointRefused", "begin", "complete", "latest", "seal", "verify"]
