"""examples/megatron_loop.py run as a user runs it: a user's own Megatron-core loop (real megatron-core
over gloo on the CPU, a real transformers engine) embedding colocate through the public API, with
tracing asked for the standard way (OTEL_TRACES_EXPORTER)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron_loop.py"

pytestmark = [
    pytest.mark.slow,  # about 6 s on an idle core
    pytest.mark.skipif(torch.cuda.is_available(), reason="the example is the CPU path (enable_cpu_path, gloo)"),
]


def test_the_loop_trains_syncs_and_restores_with_spans_from_the_otel_variables(tmp_path: Path) -> None:
    env = os.environ | {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "my-trainer"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = re.findall(r"^step (\d): reward [\d.]+, loss [-+][\d.]+, restore (.+)$", done.stdout, flags=re.M)
    # verify_cycles defaults to 2: the first two restores are checked against the drop's digests
    assert steps == [("1", "bit-identical"), ("2", "bit-identical"), ("3", "not checked")], done.stdout[-3000:]
    spans = re.findall(r'"name": "(lifecycle\.[a-z_]+)"', done.stdout)  # the console exporter's JSON
    for event in ("pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"):
        assert spans.count(f"lifecycle.{event}") == 3, (event, spans)
    assert '"service.name": "my-trainer"' in done.stdout and '"colocate.role": "rank"' in done.stdout
    # the provider is the global one, so the adapters' own spans are in the same traces
    assert {"rank.cast", "rank.bucket", "rank.digest"} <= set(re.findall(r'"name": "(rank\.[a-z_]+)"', done.stdout))
    assert list(tmp_path.iterdir()) == [], "the example writes nothing"
