"""The reward curves of the job's GPU runs, drawn from their reports, beside the copy task's chance level.

    python benchmarks/reward_curves.py --output docs/reward-curves.png \
        benchmarks/learning_llama-1b.h200.json benchmarks/families.h200.json

A report is `colocate run --report`'s JSON; `families.h200.json` holds several, under `runs`.
The goal line is three times chance (issue 39's bar: the last five steps' mean within 50 steps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHANCE = 1 / 8  # the copy task's alphabet of 8 symbols (grpo.TaskConfig)


def curves(paths: list[Path]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        reports = data["runs"] if "runs" in data else {path.stem.split(".")[0].removeprefix("learning_"): data}
        for name, report in reports.items():
            out[name] = [step["reward_mean"] for step in report["steps"] if step.get("loss") is not None]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.4, 3.6), dpi=120)
    for name, rewards in curves(args.reports).items():
        ax.plot(range(1, len(rewards) + 1), rewards, marker="." if len(rewards) < 10 else None, label=name)
    ax.axhline(CHANCE, color="grey", linestyle=":", label="chance (1/8)")
    ax.axhline(3 * CHANCE, color="grey", linestyle="--", label="goal: 3 × chance")
    ax.set(xlabel="step", ylabel="mean reward", title="colocate run --device cuda, one H200, random init")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(args.output)
    print(args.output)


if __name__ == "__main__":
    main()
