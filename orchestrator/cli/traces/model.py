"""Trace files read back into a typed span model: spans, steps, and the traces of a run.

Each line of a file is one `ExportTraceServiceRequest` in the protobuf JSON mapping, as
`OtlpJsonFileExporter` writes it, one file per process. A step is one trace rooted at the driver's
`colocate.step` span; its `lifecycle.<event>` children, the trainers' `rank.*` spans and the
engine's `engine.*` spans may sit in different files, so a step is only whole when every
process's file is read.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeAlias

from orchestrator.errors import TraceError, TraceFileError
from orchestrator.telemetry import semconv
from orchestrator.telemetry.semconv import CLOSE_SPAN, LIFECYCLE_PREFIX, START_SPAN, STEP_SPAN
from orchestrator.telemetry.tracing import parse_otlp_json
from states import Event

Value: TypeAlias = "str | bool | int | float | tuple[Value, ...] | dict[str, Value] | None"

SPARK_STEPS = 20  # the table's sparkline shows this many steps at most, the latest, to fit 80 columns
FORMATS = ("png", "svg")


# --- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One finished span. Ids are lowercase hex; `parent_id` is None for a root."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Value] = field(hash=False)
    status: str  # UNSET, OK or ERROR
    resource: dict[str, Value] = field(hash=False)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def rank(self) -> int | None:
        """The trainer rank: the span's `colocate.rank`, else its process's."""
        rank = self.attributes.get(semconv.RANK, self.resource.get(semconv.RANK))
        return rank if isinstance(rank, int) and not isinstance(rank, bool) else None

    @property
    def refused(self) -> bool:
        return self.attributes.get(semconv.REFUSED) is True

    @property
    def failed(self) -> bool:
        """A transition whose action raised: an error that is neither a refusal nor the `fault`
        transition (which is an error by nature, carrying the cause, and did what it set out to)."""
        fault = semconv.lifecycle_span(Event.FAULT)
        return (
            self.status == "ERROR"
            and not self.refused
            and self.name.startswith(LIFECYCLE_PREFIX)
            and self.name != fault
        )


@dataclass(frozen=True)
class Step:
    """One training step: its root span and every other span of its trace, by start time."""

    number: int
    root: Span
    spans: tuple[Span, ...]

    @property
    def complete(self) -> bool:
        return self.root.status != "ERROR"

    @property
    def phases(self) -> list[Span]:
        return [s for s in self.spans if s.name.startswith(LIFECYCLE_PREFIX)]

    def offset_ms(self, ns: int) -> float:
        return (ns - self.root.start_ns) / 1e6

    @cached_property
    def _by_id(self) -> dict[str, Span]:
        return {s.span_id: s for s in self.spans}

    def parent(self, span: Span) -> Span | None:
        """The span's parent, or None for the root and where the parent's file was not read."""
        return self._by_id.get(span.parent_id or "")

    def phase_of(self, span: Span) -> Span | None:
        """The nearest `lifecycle.*` ancestor, or None."""
        parent = self.parent(span)
        while parent is not None and not parent.name.startswith(LIFECYCLE_PREFIX):
            parent = self.parent(parent)
        return parent


@dataclass(frozen=True)
class Traces:
    """Every step found, by start time, and how many traces had no `colocate.step` root."""

    steps: tuple[Step, ...]
    rootless: int

    def step(self, number: int | None = None) -> Step:
        """Step `number`, or the last complete step when None."""
        if number is None:
            complete = [s for s in self.steps if s.complete]
            if not complete:
                raise TraceError(f"no complete step among {len(self.steps)} step(s)")
            return complete[-1]
        found = [s for s in self.steps if s.number == number]
        if len(found) > 1:
            raise TraceError(f"step {number} appears in {len(found)} traces: pass the files of one run only")
        if not found:
            raise TraceError(f"no step {number}; steps found: {number_ranges([s.number for s in self.steps])}")
        return found[0]


# --- reading --------------------------------------------------------------------------------------


def trace_files(paths: Sequence[Path]) -> list[Path]:
    """Files as given, folders expanded to their `*.jsonl` files."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise TraceFileError(path, 0, "folder holds no *.jsonl files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise TraceFileError(path, 0, "no such file or folder")
    return files


def read_file(path: Path) -> list[Span]:
    """Every span in one OTLP-JSON file; raises TraceFileError naming the file and line."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(path, 0, f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if not any(line.strip() for line in lines):
        raise TraceFileError(path, 0, "empty file, no spans")
    spans: list[Span] = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            spans += _parse_line(line, path, number)
    return spans


def load(paths: Sequence[Path]) -> Traces:
    """Read every file and group the spans into steps; a span read twice counts once."""
    unique = {(s.trace_id, s.span_id): s for f in trace_files(paths) for s in read_file(f)}
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for span in unique.values():
        by_trace[span.trace_id].append(span)
    steps, rootless = [], 0
    for spans in by_trace.values():
        spans.sort(key=lambda s: (s.start_ns, -s.end_ns))
        root = next((s for s in spans if s.name == STEP_SPAN and s.parent_id is None), None)
        if root is None:
            rootless += not any(s.name in (START_SPAN, CLOSE_SPAN) and s.parent_id is None for s in spans)
            continue
        number = root.attributes.get(semconv.STEP)
        others = tuple(s for s in spans if s is not root)
        steps.append(Step(number if isinstance(number, int) else -1, root, others))
    if not steps:
        raise TraceError(f"no {STEP_SPAN} span in {len(unique)} span(s): pass the driver's trace file too")
    return Traces(tuple(sorted(steps, key=lambda s: s.root.start_ns)), rootless)


def _parse_line(line: str, path: Path, number: int) -> Iterator[Span]:
    from google.protobuf import json_format

    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFileError(path, number, f"not JSON: {exc.msg} at column {exc.colno}") from None
    # json_format accepts a list or an empty object silently; neither is an export batch
    if not isinstance(data, dict) or "resourceSpans" not in data:
        raise TraceFileError(path, number, "not an OTLP trace export: expected an object with resourceSpans")
    try:
        request = parse_otlp_json(data)
    except (json_format.ParseError, ValueError) as exc:
        raise TraceFileError(path, number, f"not an OTLP trace export: {str(exc).splitlines()[0]}") from None
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield _span(span, resource, path, number)


def _span(span: Any, resource: dict[str, Value], path: Path, number: int) -> Span:
    def hex_id(raw: bytes, size: int, what: str) -> str:
        if len(raw) != size:
            raise TraceFileError(path, number, f"span {span.name!r}: {what} is {len(raw)} bytes, not {size}")
        return raw.hex()

    if span.end_time_unix_nano < span.start_time_unix_nano:
        raise TraceFileError(path, number, f"span {span.name!r} ends before it starts")
    return Span(
        name=span.name,
        trace_id=hex_id(span.trace_id, 16, "trace id"),
        span_id=hex_id(span.span_id, 8, "span id"),
        parent_id=hex_id(span.parent_span_id, 8, "parent id") if span.parent_span_id else None,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=_attributes(span.attributes),
        status=("UNSET", "OK", "ERROR")[span.status.code] if span.status.code < 3 else "UNSET",
        resource=resource,
    )


def _attributes(pairs: Iterable[Any]) -> dict[str, Value]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(any_value: Any) -> Value:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    if kind == "kvlist_value":
        return _attributes(any_value.kvlist_value.values)
    if kind == "bytes_value":
        return bytes(any_value.bytes_value).hex()
    return getattr(any_value, kind) if kind else None


def number_ranges(numbers: list[int]) -> str:
    return f"{numbers[0]}–{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) else str(numbers)
