"""A run killed mid-way and resumed, against one that never stopped: the final weights' SHA256,
the rewards step for step, the save and resume times and the checkpoint's size, in one run.

Both are `colocate run` as a user starts it (2 CPU ranks by default, the same seed). The broken
run saves every `--save-every` steps and its driver is killed by SIGKILL as step `--kill-at` + 1
begins (its log shows it), so its last complete checkpoint is step `--kill-at`; a third run
resumes from it to `--steps`.

    python benchmarks/resume_after_kill.py [--steps 30] [--kill-at 12] [--save-every 4] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def colocate(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", *args]


def finished(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(colocate(*args), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def killed_at(args: list[str], log: Path, step: int) -> None:
    """Start the run; SIGKILL its driver as soon as its log shows `step` begun."""
    proc = subprocess.Popen(colocate(*args, "--log", str(log)), cwd=ROOT, stdout=subprocess.DEVNULL)
    while proc.poll() is None:
        if log.exists() and any(json.loads(line).get("step", 0) >= step for line in log.read_text().splitlines()):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"the run ended by itself (exit {proc.returncode}) before step {step}")


def rewards(report: dict[str, Any]) -> list[float]:
    return [s["reward_mean"] for s in report["steps"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    opts = parser.parse_args()
    if opts.kill_at % opts.save_every:
        raise SystemExit("--kill-at must be a multiple of --save-every: the resume starts from a checkpoint there")
    out = Path(tempfile.mkdtemp(prefix="resume-"))
    common = ["run", "--steps", str(opts.steps), "--ranks", str(opts.ranks), "--save-every", str(opts.save_every)]
    try:
        unbroken_s = finished([*common, "--save-dir", str(out / "a"), "--report", str(out / "a.json")])
        killed_at([*common, "--save-dir", str(out / "b")], out / "b.log", opts.kill_at + 1)
        resumed_s = finished(
            [*common, "--save-dir", str(out / "b"), "--resume", str(out / "b"), "--report", str(out / "b.json")]
        )
        a, b = (json.loads((out / f"{x}.json").read_text()) for x in "ab")
        checkpoint = out / "b" / f"step-{opts.kill_at:06d}"
        size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
        saves = [s["phase_seconds"]["save"] for s in a["steps"] if "save" in s["phase_seconds"]]
        equal = [x == y for x, y in zip(rewards(a), rewards(b), strict=True)]
        result = {
            "steps": opts.steps,
            "ranks": opts.ranks,
            "killed_as_step_began": opts.kill_at + 1,
            "resumed": b["resumed"],
            "weights_sha256": {"unbroken": a["weights_sha256"], "resumed": b["weights_sha256"]},
            "weights_equal": a["weights_sha256"] == b["weights_sha256"],
            "rewards_equal_steps": f"{sum(equal)} of {len(equal)}",
            "checkpoint_bytes": size,
            "checkpoint_files": sum(1 for p in checkpoint.rglob("*") if p.is_file()),
            "save_seconds": {"first": saves[0], "later_mean": sum(saves[1:]) / max(1, len(saves) - 1)},
            "resume_load_seconds": b["resume_seconds"],
            "run_seconds": {"unbroken": round(unbroken_s, 1), "resumed": round(resumed_s, 1)},
        }
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
