"""A directory of checkpoints, each complete only once renamed into place (`store`)."""

from orchestrator.adapters.checkpoints.store import (
    MANIFEST,
    RUN_FILE,
    TRAINER,
    CheckpointRefused,
    begin,
    check_manifest,
    complete,
    latest,
    seal,
    verify,
)

__all__ = [
    "MANIFEST",
    "RUN_FILE",
    "TRAINER",
    "CheckpointRefused",
    "begin",
    "check_manifest",
    "complete",
    "latest",
    "seal",
    "verify",
]
