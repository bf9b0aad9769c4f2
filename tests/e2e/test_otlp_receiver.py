"""Spans of a 2-rank run reach a real OTLP/HTTP receiver (OpenTelemetry's own oteltest sink).

The driver, both rank actors and the engine actor export on their own, so one step's trace is
assembled from four processes: every parent must resolve, and every transition must be there.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("oteltest")

from oteltest.sink import HttpSink
from oteltest.sink.handler import RequestHandler

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ["pause_grads", "update_weights", "drop_params", "rollout", "restore", "train"]


class Collect(RequestHandler):
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.services: set[tuple[str, str, str]] = set()

    def handle_logs(self, request: Any, headers: Any) -> None: ...

    def handle_metrics(self, request: Any, headers: Any) -> None: ...

    def handle_trace(self, request: Any, headers: Any) -> None:
        for resource in request.resource_spans:
            where = {a.key: a.value for a in resource.resource.attributes}
            role = where["colocate.role"].string_value
            self.services.add(
                (role, where["service.name"].string_value, where["deployment.environment.name"].string_value)
            )
            rank = where["colocate.rank"].int_value if "colocate.rank" in where else None  # the engine has none
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: a.value for a in span.attributes}
                    self.spans.append(
                        {
                            "role": role,
                            "rank": rank,
                            "name": span.name,
                            "trace": span.trace_id.hex(),
                            "id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "attributes": attributes,
                        }
                    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def received() -> Collect:
    handler, port = Collect(), free_port()
    sink = HttpSink(handler, logging.getLogger("oteltest"), port=port)
    sink.start()
    exe = shutil.which("colocate")
    command = [exe] if exe else [sys.executable, "-m", "orchestrator.cli"]
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        # The service named only here, as OpenTelemetry lets a deployment name it.
        "OTEL_RESOURCE_ATTRIBUTES": "service.name=colocate-test,deployment.environment.name=ci%20run",
    }
    env.pop("OTEL_SERVICE_NAME", None)
    done = subprocess.run(
        [*command, "run", "--steps", "2", "--ranks", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    sink.stop()
    assert done.returncode == 0, done.stderr
    return handler


@pytest.fixture(scope="module")
def spans(received: Collect) -> list[dict[str, Any]]:
    return received.spans


def test_every_process_exported(spans: list[dict[str, Any]]) -> None:
    assert {(s["role"], s["rank"]) for s in spans} == {("driver", 0), ("rank", 0), ("rank", 1), ("engine", None)}


def test_every_process_takes_its_service_from_the_resource_attributes(received: Collect) -> None:
    """OpenTelemetry's order: OTEL_SERVICE_NAME (unset here), then OTEL_RESOURCE_ATTRIBUTES."""
    assert received.services == {(role, "colocate-test", "ci run") for role in ("driver", "rank", "engine")}


def test_each_step_is_one_trace_with_every_transition(spans: list[dict[str, Any]]) -> None:
    steps = [s for s in spans if s["name"] == "colocate.step"]
    assert len(steps) == 2
    for step in steps:
        in_trace = [s for s in spans if s["trace"] == step["trace"]]
        names = Counter(s["name"] for s in in_trace)
        assert all(names[f"lifecycle.{e}"] == 1 for e in EVENTS), names
        assert {s["role"] for s in in_trace} == {"driver", "rank", "engine"}
        assert {s["rank"] for s in in_trace if s["role"] == "rank"} == {0, 1}


def test_parents_resolve_across_processes(spans: list[dict[str, Any]]) -> None:
    ids = {(s["trace"], s["id"]) for s in spans}
    for s in spans:
        if s["parent"]:
            assert (s["trace"], s["parent"]) in ids, s
    by_id = {s["id"]: s for s in spans}
    rebuild = [s for s in spans if s["name"] == "rank.rebuild"]
    assert rebuild and all(by_id[s["parent"]]["name"] == "lifecycle.restore" for s in rebuild)
    cast = [s for s in spans if s["name"] == "rank.cast"]
    assert cast and all(by_id[s["parent"]]["name"] == "rank.rebuild" for s in cast)


def test_attributes_are_set(spans: list[dict[str, Any]]) -> None:
    update = next(s for s in spans if s["name"] == "lifecycle.update_weights")
    a = update["attributes"]
    assert a["colocate.source"].string_value == "GRADS_PAUSED"
    assert a["colocate.destination"].string_value == "WEIGHTS_SYNCED"
    assert a["colocate.bytes_moved"].int_value > 0
    pause = next(s for s in spans if s["name"] == "rank.pause")
    assert pause["attributes"]["colocate.memory_before"].int_value > 0
    assert "colocate.memory_after" in pause["attributes"]
