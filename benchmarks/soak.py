"""A long run's memory: the RSS of every process of `colocate run`, sampled as it runs, and each
one's least-squares slope in MB per 100 steps after a warm-up.

It starts `colocate run --ranks 2 --steps N --log LOG` (the arguments after `--` go to the run
too) and every `--every` seconds samples the RSS of the driver, its descendants, and every
process of the run's own Ray cluster (gcs_server, raylet, its agents, the rank and engine
actors). Those are found by a mark put in the driver's environment, which `ray start` and so each
process of the private cluster inherits (`ray start` detaches them: they are not the driver's
descendants). Each sample carries the step the run is at: the highest `step` in its log so far.
Samples of the first `--warmup` of the steps are left out of the fit. No figure is asserted.

Beside each slope of every sample, a floor slope: of the lowest RSS in each `--bucket` steps.

    python benchmarks/soak.py [--steps 1000] [--every 5] [--warmup 0.1] [--json soak.json] [-- --seed 1]
    python benchmarks/soak.py --reread soak.json  # the slopes again, no run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
MARK = "COLOCATE_SOAK"  # in the driver's environment, and so in its Ray cluster's every process
MB = 1e6


def name_of(proc: psutil.Process) -> str:
    """A process's role, from its command line: `ray::TrainerRank`, `gcs_server`, `raylet`, ..."""
    line = proc.cmdline()
    if not line:
        return proc.name()
    if line[0].startswith("ray::"):
        return line[0].split(".")[0].split()[0]  # ray::TrainerRank.step -> ray::TrainerRank
    for word in line[:3]:
        base = os.path.basename(word)
        if base in {"gcs_server", "raylet"}:
            return base
        if base.endswith(".py"):  # ray/_private/workers/setup_worker.py -> workers/setup_worker
            return "/".join(Path(word).with_suffix("").parts[-2:])
    if "-m" in line:
        return line[line.index("-m") + 1]
    return os.path.basename(line[0])


def run_processes(driver: psutil.Process, token: str) -> list[psutil.Process]:
    """The driver, its descendants, and every process that carries `token` in its environment."""
    found = {driver.pid: driver}
    with contextlib.suppress(psutil.Error):
        found.update((c.pid, c) for c in driver.children(recursive=True))
    for proc in psutil.process_iter(["environ"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["environ"] or {}).get(MARK) == token:
                found[proc.pid] = proc
    found.pop(os.getpid(), None)
    return list(found.values())


class LogStep:
    """The highest `step` the run's JSON log shows so far, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step, self.partial = path, 0, 0, ""

    def read(self) -> int:
        with contextlib.suppress(OSError), self.path.open() as file:
            file.seek(self.offset)
            chunk = file.read()
            self.offset = file.tell()
            *lines, self.partial = (self.partial + chunk).split("\n")
            for line in lines:
                with contextlib.suppress(ValueError, AttributeError):
                    step = json.loads(line).get("step")
                    if isinstance(step, int):
                        self.step = max(self.step, step)
        return self.step


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (step, MB) points, in MB per 100 steps (None: under 3 points or one step)."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx


def floor(points: list[tuple[int, float]], bucket: int) -> list[tuple[int, float]]:
    """The lowest MB in each `bucket` steps, at the bucket's middle step: a rank's RSS swings by tens
    of MB within a step (its buffers dropped and rebuilt), so a sample's phase weighs on a slope
    of every sample; the floor of each bucket is the memory it keeps."""
    lowest: dict[int, float] = {}
    for step, mb in points:
        lowest[step // bucket] = min(mb, lowest.get(step // bucket, mb))
    return [(b * bucket + bucket // 2, mb) for b, mb in sorted(lowest.items())]


def soak(opts: argparse.Namespace, extra: list[str], log: Path) -> tuple[dict[str, dict[str, Any]], int, float]:
    """Run it, sample it; per process label: pid, name, samples [(t, step, MB)]."""
    token = uuid.uuid4().hex
    env = {**os.environ, MARK: token}
    args = ["run", "--ranks", str(opts.ranks), "--steps", str(opts.steps), "--log", str(log), *extra]
    start = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL
    )
    driver = psutil.Process(child.pid)
    steps = LogStep(log)
    procs: dict[int, dict[str, Any]] = {}
    while child.poll() is None:
        step = steps.read()
        now = round(time.monotonic() - start, 1)
        for proc in run_processes(driver, token):
            with contextlib.suppress(psutil.Error):
                rss = proc.memory_info().rss / MB
                entry = procs.setdefault(proc.pid, {"pid": proc.pid, "name": name_of(proc), "samples": []})
                if (now_name := name_of(proc)).startswith("ray::") and now_name != "ray::IDLE":
                    entry["name"] = now_name  # a worker is named for the actor it became
                entry["samples"].append((now, step, round(rss, 2)))
        if opts.progress and procs:
            total = sum(e["samples"][-1][2] for e in procs.values() if e["samples"][-1][0] == now)
            print(f"t={now:7.1f}s step={step:5d} processes={len(procs)} rss={total:8.1f} MB", file=sys.stderr)
        time.sleep(opts.every)
    return label(procs), child.returncode, time.monotonic() - start


def label(procs: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each process under its name, numbered by pid where a name recurs (ray::TrainerRank #1, #2)."""
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in sorted(procs.values(), key=lambda e: e["pid"]):
        by_name[entry["name"]].append(entry)
    out = {}
    for name, entries in by_name.items():
        for i, entry in enumerate(entries, 1):
            out[name if len(entries) == 1 else f"{name} #{i}"] = entry
    return out


def summarise(procs: dict[str, dict[str, Any]], steps: int, warmup: float, bucket: int) -> dict[str, dict[str, Any]]:
    first_step = int(steps * warmup)
    rows = {}
    for key, entry in procs.items():
        kept = [(s, mb) for _, s, mb in entry["samples"] if s > first_step]
        rows[key] = {
            "pid": entry["pid"],
            "samples": len(entry["samples"]),
            "fitted": len(kept),
            "first_mb": entry["samples"][0][2],
            "after_warmup_mb": kept[0][1] if kept else None,
            "last_mb": entry["samples"][-1][2],
            "max_mb": max(mb for *_, mb in entry["samples"]),
            "mb_per_100_steps": None if (s := slope(kept)) is None else round(s, 2),
            "floor_mb_per_100_steps": None if (s := slope(floor(kept, bucket))) is None else round(s, 2),
        }
    totals: dict[int, float] = defaultdict(float)  # the sum over processes, per sample time
    steps_at: dict[float, int] = {}
    for entry in procs.values():
        for t, s, mb in entry["samples"]:
            totals[t] += mb
            steps_at[t] = s
    kept = [(steps_at[t], mb) for t, mb in totals.items() if steps_at[t] > first_step]
    rows["all"] = {
        "fitted": len(kept),
        "mb_per_100_steps": None if (s := slope(kept)) is None else round(s, 2),
        "floor_mb_per_100_steps": None if (s := slope(floor(kept, bucket))) is None else round(s, 2),
        "last_mb": round(totals[max(totals)], 1) if totals else None,
    }
    return rows


def show(rows: dict[str, dict[str, Any]], goal: float) -> None:
    def fmt(x: Any, spec: str = "8.1f") -> str:
        return "-".rjust(8) if x is None else format(x, spec)

    print(f"{'process':28} {'pid':>7} {'first':>8} {'warm':>8} {'last':>8} {'max':>8} {'MB/100st':>9} {'floor':>7}"
          "  floor vs goal")  # fmt: skip
    for key, row in rows.items():
        if key == "all":
            continue
        s = row["floor_mb_per_100_steps"]
        verdict = "" if s is None else ("ok" if s <= goal else f"{s / goal:.1f}x goal")
        print(
            f"{key[:28]:28} {row['pid']:7d} {fmt(row['first_mb'])} {fmt(row['after_warmup_mb'])} "
            f"{fmt(row['last_mb'])} {fmt(row['max_mb'])} {fmt(row['mb_per_100_steps'], '9.2f')} {fmt(s, '7.2f')}  {verdict}"
        )
    print(f"{'all processes':28} {'':7} {'':8} {'':8} {fmt(rows['all']['last_mb'])} {'':8} "
          f"{fmt(rows['all']['mb_per_100_steps'], '9.2f')} {fmt(rows['all']['floor_mb_per_100_steps'], '7.2f')}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.1, help="the share of the steps left out of the fit")
    parser.add_argument("--goal", type=float, default=1.0, help="MB per 100 steps a process may grow")
    parser.add_argument("--bucket", type=int, default=25, help="steps per bucket of the floor slope")
    parser.add_argument("--json", type=Path, help="write the samples and the slopes here")
    parser.add_argument("--reread", type=Path, help="no run: the slopes of the samples in this --json file")
    parser.add_argument("--progress", action="store_true", help="a line per sample on stderr")
    opts, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if opts.reread:
        old = json.loads(opts.reread.read_text())
        opts.steps, opts.ranks, extra = old["steps"], old["ranks"], old["extra"]
        code, seconds = old["exit"], old["seconds"]
        procs = {k: {"pid": old["processes"][k]["pid"], "samples": v} for k, v in old["samples"].items()}
    else:
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            procs, code, seconds = soak(opts, extra, Path(tmp) / "run.log")
    rows = summarise(procs, opts.steps, opts.warmup, opts.bucket)
    print(f"colocate run --ranks {opts.ranks} --steps {opts.steps} {' '.join(extra)}: exit {code}, {seconds:.0f} s")
    show(rows, opts.goal)
    if opts.json:
        result = {"steps": opts.steps, "ranks": opts.ranks, "extra": extra, "exit": code, "seconds": round(seconds, 1),
                  "warmup_steps": int(opts.steps * opts.warmup), "processes": rows,
                  "samples": {k: e["samples"] for k, e in procs.items()}}  # fmt: skip
        opts.json.write_text(json.dumps(result, indent=1) + "\n")
    if code != 0:
        raise SystemExit(f"the run failed: exit {code}")


if __name__ == "__main__":
    main()
