"""The job's step, phase by phase, against the copy rates of the same machine measured in the same run.

Runs `colocate run` as a user does (a subprocess, `--report`), then, in this process on the same
device, times the copies that bound each phase:

- a pinned host copy of the bytes `pause_grads` sent to the host and `restore` brought back, each
  way (device → pinned host, pinned host → device): the ceiling of sleep and wake;
- a device-to-device copy of the bytes `update_weights` pushed: the ceiling of a push in one copy.

For each phase of the steady steps (3 on: steps 1 and 2 lay out the host arena and re-home the Adam
moments) it gives the bytes the phase copied, its seconds, its GB/s and the ratio of that to the
ceiling, and the lifecycle's overhead (pause_grads + update_weights + drop_params + restore)
against train + rollout. Writes JSON (`--out`) and prints a table.

    python benchmarks/step_overhead.py --model llama-1b --steps 6 [--offload auto] [--out step.json] [-- run options]

On the CPU (`--device cpu`) it runs the same way, as a check of the script; the copy ceilings are
then plain host copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.digest_rate import seconds

OVERHEAD = ("pause_grads", "update_weights", "drop_params", "restore")
WORK = ("train", "rollout")
# Each phase that copies, and the copy that bounds it.
CEILING = {"pause_grads": "to_host", "restore": "from_host", "update_weights": "device_copy"}


def copy_rates(host_bytes: int, device_bytes: int, device: str) -> dict[str, float]:
    """GB/s of each ceiling: payload bytes over seconds (a copy of N bytes counts N)."""
    n_host, n_dev = max(host_bytes, 1 << 20), max(device_bytes, 1 << 20)
    pin = device == "cuda"
    src = torch.empty(n_host, dtype=torch.uint8, device=device).random_(0, 256)
    host = torch.empty(n_host, dtype=torch.uint8, pin_memory=pin)
    a = torch.empty(n_dev, dtype=torch.uint8, device=device).random_(0, 256)
    b = torch.empty_like(a)
    cuda = device == "cuda"
    rates = {
        "to_host": n_host / seconds(lambda: host.copy_(src, non_blocking=pin), 5, cuda) / 1e9,
        "from_host": n_host / seconds(lambda: src.copy_(host, non_blocking=pin), 5, cuda) / 1e9,
        "device_copy": n_dev / seconds(lambda: b.copy_(a), 5, cuda) / 1e9,
    }
    return rates


def _steady(report: dict[str, Any]) -> list[dict[str, Any]]:
    done = [s for s in report["steps"] if s["loss"] is not None]
    return [s for s in done if s["step"] >= 3] or done


def phases(report: dict[str, Any], rates: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per event over the steady steps: mean seconds, mean bytes copied, GB/s, ratio to its ceiling."""
    steps = _steady(report)
    out: dict[str, dict[str, float]] = {}
    for event in (*OVERHEAD, *WORK):
        times = [s["phase_seconds"][event] for s in steps if event in s["phase_seconds"]]
        if not times:
            continue
        row: dict[str, float] = {"seconds": statistics.mean(times), "seconds_max": max(times)}
        moved = [s["phase_bytes"].get(event, 0) for s in steps]
        if any(moved):
            row["bytes"] = statistics.mean(moved)
            row["gbps"] = row["bytes"] / row["seconds"] / 1e9
            if event in CEILING:
                row["ceiling_gbps"] = rates[CEILING[event]]
                row["of_ceiling"] = row["gbps"] / rates[CEILING[event]]
        out[event] = row
    return out


def run_job(args: argparse.Namespace, extra: list[str], report_path: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "orchestrator.cli", "run", "--device", args.device, "--ranks", "1",
        "--model", args.model, "--steps", str(args.steps), "--report", str(report_path), *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads(report_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--offload", choices=("auto", "always", "never"), default="auto", help="the run's --offload")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args, extra = parser.parse_known_args()
    extra = ["--offload", args.offload, *(a for a in extra if a != "--")]
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (steps 3 on are the steady state), got {args.steps}")
    with tempfile.TemporaryDirectory() as folder:
        report = run_job(args, extra, Path(folder) / "report.json")
    steady = _steady(report)
    host_bytes = max((s["phase_bytes"].get("pause_grads", 0) for s in steady), default=0)
    push_bytes = max((s["phase_bytes"].get("update_weights", 0) for s in steady), default=0)
    rates = copy_rates(host_bytes, push_bytes, args.device)
    table = phases(report, rates)
    overhead = sum(table[e]["seconds"] for e in OVERHEAD if e in table)
    work = sum(table[e]["seconds"] for e in WORK if e in table)
    result = {
        "model": args.model, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "steps": args.steps, "run_options": extra, "copy_rates_gbps": rates, "phases": table,
        "lifecycle_overhead_s": overhead, "train_plus_rollout_s": work,
        "overhead_over_work": overhead / work if work else None,
        "host_pinned_bytes_per_rank": report["host_pinned_bytes_per_rank"],
        "host_pinned_bytes_by_step": {s["step"]: s["host_pinned_bytes"] for s in report["steps"]},
        "rewards": [s["reward_mean"] for s in report["steps"]],
    }  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'phase':<16}{'s':>9}{'bytes':>16}{'GB/s':>9}{'ceiling':>9}{'of it':>7}")
    for event, row in table.items():
        rate = (
            f"{row['gbps']:>9.1f}{row['ceiling_gbps']:>9.1f}{row['of_ceiling']:>7.0%}" if "ceiling_gbps" in row else ""
        )
        print(f"{event:<16}{row['seconds']:>9.4f}{row.get('bytes', 0):>16,.0f}{rate}")
    print(f"lifecycle {overhead:.3f} s against train + rollout {work:.3f} s per step; "
          f"pinned host per rank {result['host_pinned_bytes_per_rank']:,} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
