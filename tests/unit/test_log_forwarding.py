"""Log lines kept in a worker's process and written by the driver's (`telemetry.logs`): what each
line keeps on the way, and where the driver writes notes and transitions."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from orchestrator.telemetry.logs import LIFECYCLE, configure_logging, forward, keep_lines, note_leftover


@pytest.fixture(autouse=True)
def reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def test_a_workers_lines_are_kept_with_their_process_level_time_and_span_until_taken() -> None:
    lines = keep_lines("rank 1")
    span = TracerProvider().get_tracer("t").start_span("rank.join_weight_group")
    with trace.use_span(span, end_on_exit=True):
        note_leftover("http://a:1", "a group", "destroyed it")
    structlog.get_logger().info("after", n=3)
    (kept, after) = lines.take()
    assert lines.take() == []  # each line is handed out once
    ids = span.get_span_context()
    assert kept["event"] == "leftover" and kept["level"] == "warning" and kept["process"] == "rank 1"
    assert (kept["trace_id"], kept["span_id"]) == (format(ids.trace_id, "032x"), format(ids.span_id, "016x"))
    assert kept["timestamp"].endswith("Z") and kept["done"] == "destroyed it"
    assert after["level"] == "info" and after["n"] == 3 and after["trace_id"] is None


def test_the_driver_writes_forwarded_lines_as_written_and_hands_warnings_on() -> None:
    lines = keep_lines("engine 1")
    note_leftover("http://a:1", "a group", "destroyed it")
    structlog.get_logger().info("quiet")
    kept = lines.take()
    file, warned = io.StringIO(), []
    sink = configure_logging(file, warn=warned.append)
    assert sink is not None
    forward(kept)
    structlog.get_logger(LIFECYCLE).warning("update_weights", src="TRAIN", refused=["no"])  # the run says it
    sink.flush()
    written = [json.loads(line) for line in file.getvalue().splitlines()]
    assert [w["event"] for w in written] == ["leftover", "quiet", "update_weights"]
    assert written[0] == kept[0] and written[1] == kept[1]  # its own time, process, level and ids
    assert [json.loads(w) for w in warned] == [kept[0]]


def test_without_a_log_a_note_at_warning_still_reaches_warn() -> None:
    warned: list[str] = []
    assert configure_logging(None, warn=warned.append) is None
    note_leftover("http://a:1", "a group", "destroyed it")
    structlog.get_logger().info("quiet")
    (line,) = map(json.loads, warned)
    assert line["event"] == "leftover" and "process" not in line and line["trace_id"] is None
