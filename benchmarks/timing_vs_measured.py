"""The time model's seconds per phase (`orchestrator/plan/timing.py`) next to what a run measured.

Reads what `benchmarks/step_overhead.py --out` wrote (one model, steady phases, the copy rates of
the same GPU) or `scripts/gpu_measure.sh families`' JSON (`runs`, per-step phase seconds), plans
the same model at one rank, with the regions the run moved, and predicts each phase twice: at the
published rates (`LinkRates()`) and, where the JSON has them, at the copy rates measured in the same
run. Prints measured / predicted per phase and whether it is within 20%.

    python benchmarks/plan_vs_measured.py --timing benchmarks/step_llama-1b.always.h200.json ...
    python benchmarks/timing_vs_measured.py benchmarks/step_llama-1b.always.h200.json ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.errors import ConfigError
from orchestrator.plan.figures import LinkRates
from orchestrator.plan.memory import Parallelism, Plan, plan
from orchestrator.plan.presets import load_model
from orchestrator.plan.timing import PHASES, StageTime, predict
from states import Offload, Region

WITHIN = 0.20


@dataclass(frozen=True, slots=True)
class Recorded:
    """One run's steady seconds per phase, as a JSON recorded them."""

    label: str
    model: str
    params: int | None  # params per rank the run held, where the JSON says: a shrunk model shows here
    seconds: dict[str, float]
    pause_bytes: float  # what pause_grads copied to the host: 0 where the run kept `default`
    rates: LinkRates | None  # the copy rates measured in the same run, where it has them


def recorded(path: Path) -> list[Recorded]:
    d = json.loads(path.read_text())
    if "phases" in d:  # benchmarks/step_overhead.py
        rates = d.get("copy_rates_gbps")
        measured = (
            LinkRates(
                to_host_gbps=rates["to_host"],
                from_host_gbps=rates["from_host"],
                device_copy_gbps=rates["device_copy"],
                source=f"measured in the same run ({path.name})",
            )
            if rates
            else None
        )
        label = f"{d['model']} {' '.join(d.get('run_options', []))} ({path.name})"
        seconds = {k: v["seconds"] for k, v in d["phases"].items()}
        return [
            Recorded(label, d["model"], None, seconds, d["phases"].get("pause_grads", {}).get("bytes", 0), measured)
        ]
    out = []
    for name, run in d["runs"].items():  # scripts/gpu_measure.sh families: per-step phase seconds
        steps = [s for s in run["steps"] if s["step"] >= 3] or run["steps"]
        seconds = {k: statistics.mean(s["phase_seconds"][k] for s in steps) for k in steps[0]["phase_seconds"]}
        pause = statistics.mean(s["phase_bytes"].get("pause_grads", 0) for s in steps)
        out.append(Recorded(f"{run['model']} ({path.name})", name, run.get("params_per_rank"), seconds, pause, None))
    return out


def planned(r: Recorded) -> tuple[Plan, frozenset[Region]]:
    """One rank of the model, with `default` kept where the run copied (next to) nothing at pause_grads."""
    p = plan(load_model(r.model), Parallelism(), offload=Offload.ALWAYS)
    rank = p.ranks[0]
    if r.params is not None and r.params != rank.params:
        raise ConfigError([f"the run held {r.params:,} params a rank, the plan of {r.model} {rank.params:,}: shrunk"])
    keep = frozenset({Region.GRAD_BUFFER, Region.DEFAULT}) if r.pause_bytes < rank.optimizer_state / 2 else frozenset()
    return p, keep


def rows(r: Recorded, stage: StageTime, calibrated: StageTime | None) -> list[dict[str, Any]]:
    out = []
    for name in PHASES:
        have = r.seconds.get(name)
        if have is None:
            continue
        row: dict[str, Any] = {"phase": name, "measured_s": have}
        for key, st in (("published", stage), ("run_rates", calibrated)):
            if st is None:
                continue
            x = st.phases[name]
            ratio = have / x.seconds if x.seconds else None
            row[key] = {
                "predicted_s": x.seconds,
                "measured_over_predicted": ratio,
                "within_20pct": None if ratio is None else abs(ratio - 1) <= WITHIN,
                "bound": x.bound.says() if x.bound else "nothing crosses a link (not modelled)",
            }
        out.append(row)
    return out


def compare(paths: list[Path]) -> list[dict[str, Any]]:
    results = []
    for path in paths:
        for r in recorded(path):
            try:
                p, keep = planned(r)
            except ConfigError as exc:  # a shrunk family model the planner's presets do not hold
                results.append({"run": r.label, "skipped": str(exc)})
                continue
            train = r.seconds.get("train")
            stage = predict(p, train_seconds=train, keep=keep)[0]
            calibrated = predict(p, r.rates, train_seconds=train, keep=keep)[0] if r.rates else None
            moments = {"seconds": stage.moments.seconds, "visible_s": stage.moments.visible, "train_s": train}
            results.append({"run": r.label, "rows": rows(r, stage, calibrated), "moments_stream": moments})
    return results


def _cell(row: dict[str, Any], key: str) -> str:
    x = row.get(key)
    if x is None:
        return "-"
    if x["measured_over_predicted"] is None:
        return f"{x['predicted_s']:.4f}, not modelled"
    ok = "yes" if x["within_20pct"] else "no"
    return f"{x['predicted_s']:.4f} ({x['measured_over_predicted']:.2f}x, {ok})"


def show(results: list[dict[str, Any]]) -> None:
    for res in results:
        print(f"\n{res['run']}")
        if "skipped" in res:
            print(f"  skipped: {res['skipped']}")
            continue
        print(
            f"  {'phase':<16}{'measured s':>12}  {'published rates: s (x, <=20%)':<34}{'run rates: s (x, <=20%)':<34}"
        )
        for row in res["rows"]:
            print(
                f"  {row['phase']:<16}{row['measured_s']:>12.4f}  {_cell(row, 'published'):<34}{_cell(row, 'run_rates'):<34}"
            )
        for row in res["rows"]:
            print(f"    {row['phase']} bound: {row['published']['bound']}")
        m = res["moments_stream"]
        visible = "unknown" if m["visible_s"] is None else f"{m['visible_s']:.4f} s"
        print(
            f"  moments' stream (not built): {m['seconds']:.4f} s, visible {visible} under a {m['train_s']:.3f} s train"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+", help="step_overhead.py or families JSON files")
    parser.add_argument("--out", type=Path, help="write the comparison here as JSON")
    args = parser.parse_args(argv)
    results = compare(args.files)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    show(results)


if __name__ == "__main__":
    main()
