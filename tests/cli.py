"""Running the `colocate` command as a user does: the installed script, or `python -m` without one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CYCLE = ["TRAIN", "GRADS_PAUSED", "WEIGHTS_SYNCED", "PARAMS_DROPPED", "ROLLOUT", "TRAIN"]


def colocate(*args: str) -> list[str]:
    exe = shutil.which("colocate")
    return [exe, *args] if exe else [sys.executable, "-m", "orchestrator.cli", *args]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(colocate(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
