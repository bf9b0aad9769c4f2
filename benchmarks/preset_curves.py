"""Each GPU preset's reward curve: `colocate run --device cuda --ranks 1 --model NAME` on one GPU.

Runs the CLI once per preset, in a process of its own (a fresh CUDA context each), with `--report`
to a file next to `--out`, and writes one JSON object: per preset the command, its exit code and
wall seconds, the reward of each finished step, and the mean reward over the first and the last
five. `--out` is rewritten after each preset, so a later preset that fails or times out leaves the
earlier ones' curves.

    python benchmarks/preset_curves.py --out curves.json [--models qwen-0.5b llama-1b] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.job.presets import PRESETS


def curve(report: dict[str, Any]) -> dict[str, Any]:
    """The rewards of the steps that finished (those with a loss), with the first- and last-5 means,
    as `colocate run`'s summary computes them."""
    rewards = [s["reward_mean"] for s in report["steps"] if s.get("loss") is not None]
    if not rewards:
        return {"rewards": [], "first5_mean": None, "last5_mean": None}
    first, last = rewards[:5], rewards[-5:]
    return {
        "rewards": [round(r, 4) for r in rewards],
        "first5_mean": round(sum(first) / len(first), 4),
        "last5_mean": round(sum(last) / len(last), 4),
    }


def run_preset(name: str, steps: int, seed: int, timeout_s: float, report: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "orchestrator.cli", "run", "--device", "cuda", "--ranks", "1",
        "--model", name, "--steps", str(steps), "--seed", str(seed), "--report", str(report),
    ]  # fmt: skip
    report.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        code: int | None = subprocess.run(command, timeout=timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:  # the child was killed; a report is written only at the end
        code = None
    result: dict[str, Any] = {
        "command": " ".join(command[1:]), "exit_code": code, "seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    if report.exists():
        data = json.loads(report.read_text())
        result |= curve(data) | {"error": data.get("error"), "report": str(report)}
    else:
        result |= curve({"steps": []}) | {
            "error": f"no report (timed out after {timeout_s:.0f} s)" if code is None else "no report"
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument(
        "--models", nargs="+", choices=[p for p in PRESETS if p != "tiny"], default=["qwen-0.5b", "llama-1b"]
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=290.0, help="seconds each preset's run may take")
    args = parser.parse_args()
    if not args.out.parent.is_dir():
        raise SystemExit(f"--out {args.out}: folder {args.out.parent} does not exist")
    results: dict[str, Any] = {"steps": args.steps, "seed": args.seed, "presets": {}}
    for name in args.models:
        report = args.out.with_name(f"{args.out.stem}.run_{name}.json")
        results["presets"][name] = outcome = run_preset(name, args.steps, args.seed, args.timeout, report)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(
            f"{name}: exit {outcome['exit_code']}, {outcome['seconds']} s, {len(outcome['rewards'])} steps, "
            f"mean reward first / last 5: {outcome['first5_mean']} / {outcome['last5_mean']}",
            flush=True,
        )
    failed = [n for n, r in results["presets"].items() if r["exit_code"] != 0]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
