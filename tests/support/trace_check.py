"""What every trace of a run must hold, read from the raw OTLP/JSON lines (through the protobuf
mapping, not through `colocate trace`'s own reader), with the run's JSON log beside it.

`problems(trace_file, log_file)` lists every breach, so a test shows them all at once:

- each trace has one root (`colocate.start`, `colocate.step` or `colocate.close`), every parent
  resolves in it, and no span ends after its parent (`whole`: a run's every trace file passes it);
- every span carries the attributes docs/tracing.md promises for its kind;
- a lifecycle span names a destination only if its event entered it: never a refused or failed
  one, and each step's destinations chain (an event leaves the phase the one before entered);
- a failed action's span carries its cause's exception with a traceback, and so does the fault;
- each log line's `trace_id`/`span_id` name the span of that same transition.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.telemetry.tracing import parse_otlp_json

LIFECYCLE_KEYS = {"colocate.event", "colocate.source", "colocate.step", "colocate.rank", "colocate.mode"}
PROCESS_KEYS = {"colocate.memory_before", "colocate.memory_after"}


@dataclass
class Raw:
    name: str
    trace: str
    id: str
    parent: str
    role: str
    error: bool
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    start: int = 0
    end: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def read(trace_file: Path) -> list[Raw]:
    spans = []
    for line in trace_file.read_text().splitlines():
        for resource in parse_otlp_json(line).resource_spans:
            where = {a.key: _value(a.value) for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for s in scope.spans:
                    spans.append(
                        Raw(
                            name=s.name,
                            trace=s.trace_id.hex(),
                            id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            role=str(where.get("colocate.role")),
                            error=s.status.code == 2,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                        )
                    )
    return spans


def edges(trace_file: Path) -> set[tuple[str, str]]:
    """(parent, child) span names of every parent-child pair in the file."""
    spans = read(trace_file)
    names = {span.id: span.name for span in spans}
    return {(names[span.parent], span.name) for span in spans if span.parent in names}


def processes_per_trace(trace_file: Path) -> dict[str, set[tuple[str, int | None]]]:
    """The processes, as (role, rank), with spans in each step's trace (the start-up's trace is not a step's)."""
    seen: dict[str, set[tuple[str, int | None]]] = defaultdict(set)
    steps: set[str] = set()
    for line in trace_file.read_text().splitlines():
        for resource in parse_otlp_json(line).resource_spans:
            where = {a.key: a.value for a in resource.resource.attributes}
            rank = where["colocate.rank"].int_value if "colocate.rank" in where else None  # the engine has none
            process = (where["colocate.role"].string_value, rank)
            for scope in resource.scope_spans:
                for span in scope.spans:
                    seen[span.trace_id.hex()].add(process)
                    if span.name == "colocate.step":
                        steps.add(span.trace_id.hex())
    return {trace: processes for trace, processes in seen.items() if trace in steps}


ROOTS = ("colocate.start", "colocate.step", "colocate.close")  # docs/tracing.md: the traces of a run


def whole(trace_file: Path) -> list[str]:
    """Every breach, in a run's trace file, of what docs/tracing.md promises of every span: it is
    in the trace of a step, of the start-up or of the close (one root, one of `ROOTS`, every parent
    in it), and it ends no later than its parent."""
    return _whole(read(trace_file))


def _whole(spans: list[Raw]) -> list[str]:
    found: list[str] = []
    by_trace: dict[str, list[Raw]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace].append(span)
    for trace, members in by_trace.items():
        by_id = {s.id: s for s in members}
        roots = [s.name for s in members if not s.parent]
        if len(roots) != 1 or roots[0] not in ROOTS:
            found.append(f"trace {trace}: roots {roots}, expected one of {', '.join(ROOTS)}")
        for s in members:
            parent = by_id.get(s.parent)
            if s.parent and parent is None:
                found.append(f"{s.name} {s.id}: parent {s.parent} is not in its trace")
            elif parent is not None and s.end > parent.end:
                late = (s.end - parent.end) / 1e6
                found.append(f"{s.name} {s.id} ends {late:.3f} ms after its parent {parent.name} {parent.id}")
    return found


def problems(trace_file: Path, log_file: Path | None = None) -> list[str]:
    spans = read(trace_file)
    found = _whole(spans)
    by_trace: dict[str, list[Raw]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace].append(span)
    for members in by_trace.values():
        found += _chain(sorted((s for s in members if s.name.startswith("lifecycle.")), key=lambda s: s.start))
    for span in spans:
        found += [f"{span.name} {span.id}: {p}" for p in _promised(span)]
    if log_file is not None:
        found += _log_ids(spans, log_file)
    return found


def _promised(span: Raw) -> list[str]:
    a, missing = span.attributes, []
    if span.name.startswith("lifecycle."):
        missing = sorted(LIFECYCLE_KEYS - a.keys())
        refused, failed = a.get("colocate.refused") is True, span.error and span.name != "lifecycle.fault"
        if ("colocate.destination" in a) == (refused or failed):
            destination = a.get("colocate.destination")
            return [f"destination {destination!r} but refused={refused} failed={failed}", *_missing(missing)]
        if span.error and not refused and not _traceback(span):
            missing.append("an exception event with its traceback")
        if span.name == "lifecycle.fault" and "colocate.cause" not in a:
            missing.append("colocate.cause")
    elif span.name.startswith(("rank.", "engine.")):
        missing = sorted(PROCESS_KEYS - a.keys())
        if span.name.startswith("rank.") and "colocate.rank" not in a:
            missing.append("colocate.rank")
        if span.name in ("rank.pause", "rank.resume") and "colocate.region" not in a:
            missing.append("colocate.region")
        if span.name == "rank.bucket":
            missing += sorted({"colocate.bytes", "colocate.tensors"} - a.keys())
    elif span.name == "colocate.engine_matches_trainer" and not isinstance(a.get(span.name), bool):
        missing.append(f"{span.name} (true or false)")
    elif span.name == "colocate.step":
        missing = sorted({"colocate.step", "colocate.rank"} - a.keys())
    return _missing(missing)


def _missing(keys: list[str]) -> list[str]:
    return [f"missing {key}" for key in keys]


def _traceback(span: Raw) -> bool:
    return any(name == "exception" and "Traceback" in str(e.get("exception.stacktrace")) for name, e in span.events)


def _chain(phases: list[Raw]) -> list[str]:
    """Within one step, each event that entered a phase left the one the event before entered."""
    found, at = [], None
    for span in phases:
        a = span.attributes
        if at is not None and a.get("colocate.source") != at and "colocate.destination" in a:
            found.append(f"{span.name}: left {a.get('colocate.source')} but the step was in {at}")
        at = a.get("colocate.destination", at)
    return found


def _log_ids(spans: list[Raw], log_file: Path) -> list[str]:
    by_id = {(s.trace, s.id): s for s in spans}
    found = []
    for line in log_file.read_text().splitlines():
        entry = json.loads(line)
        if "src" not in entry or entry.get("trace_id") is None:
            continue  # not a transition line (a `noop` note), or tracing was off
        span = by_id.get((entry["trace_id"], entry["span_id"]))
        if span is None or span.name != f"lifecycle.{entry['event']}":
            found.append(f"log line {entry['event']} step {entry['step']}: its ids name {span and span.name}")
    return found
