"""The job's local Ray: where the rank and engine actors of `orchestrator.workers` run.

The workers themselves, the driver's typed calls to them and their Protocol facades live in
`orchestrator.workers`.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def start_ray(ranks: int) -> Callable[[], None]:
    """A local Ray with one logical CPU per actor (ranks + engine); returns what stops it and
    removes its session folder (Ray leaves `_temp_dir` behind)."""
    import logging
    import shutil
    import tempfile

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="colocate-ray-")  # short: Ray's socket paths must fit in 107 bytes
    try:
        ray.init(
            num_cpus=ranks + 1,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            _temp_dir=temp_dir,
            runtime_env={"env_vars": {"TORCHDYNAMO_DISABLE": "1"}},
        )
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise

    def shutdown() -> None:
        try:
            ray.shutdown()
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)

    return shutdown
