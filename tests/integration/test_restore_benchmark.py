"""benchmarks/restore.py on the CPU: its DP=N path (gloo) runs, and bad input is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "restore.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )


@pytest.mark.slow
def test_two_ranks_restore_bit_identical_with_the_same_params() -> None:
    done = _bench("--preset", "tiny", "--ranks", "2", "--repeats", "1", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["summary"]["ranks"] == 2
    assert out["summary"]["bit_identical_all_ranks"] is True
    assert out["summary"]["same_params_all_ranks"] is True
    for rank in out["ranks"]:
        assert rank["world_size"] == 2
        assert rank["cast_path"] == "megatron"  # no Triton kernel on the CPU
        assert set(rank["bit_identical"]) == {"remat", "backup"}
        assert set(rank["freed_bytes"]) == {"grad_buffer", "default", "param_buffer"}
        assert 0 < rank["shard_params"] < rank["params"]  # each rank casts its own shard only


def test_ranks_below_one_are_refused() -> None:
    done = _bench("--ranks", "0")
    assert done.returncode == 2
    assert "--ranks must be at least 1, got 0" in done.stderr
