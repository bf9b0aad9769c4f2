"""Telemetry that cannot export says so once (issue 42, item 5): `colocate run` with an OTLP
endpoint that refuses connections warns in one line where the spans were to go, goes on, exits 0,
and its report counts the spans dropped; the SDK's per-retry warnings are not printed. The same
run against a real OTLP receiver warns nothing and drops none. One rank, in the driver's process,
so the driver's exporter carries every span of the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import ROOT, colocate

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytest.importorskip("oteltest")

from tests.support.otlp_receiver import receiver

pytestmark = pytest.mark.slow

WARNING = "are not being delivered"
SDK_LINES = ("Transient error", "Failed to export", "Exception while exporting")


def _run(tmp_path: Path, endpoint: str, **otel: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "report.json"
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **otel}
    args = colocate("run", "--steps", "1", "--ranks", "1", "--report", str(report))
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(report.read_text())


def test_a_refused_endpoint_is_told_once_and_the_report_counts_the_spans_dropped(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    # A failed batch is retried for up to the exporter's timeout: 1 s keeps the run's end short.
    done, report = _run(tmp_path, f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_TIMEOUT="1")
    lines = done.stderr.splitlines()
    told = [line for line in lines if WARNING in line]
    assert len(told) == 1, done.stderr
    assert f"spans to http://127.0.0.1:{port}/v1/traces {WARNING}" in told[0], told
    sdk_said = [line for line in lines if WARNING not in line and any(sdk in line for sdk in SDK_LINES)]
    assert not sdk_said, done.stderr  # the one line quotes the SDK's reason; the SDK says nothing itself
    assert report["spans_dropped"] > 0, report["spans_dropped"]


def test_a_receiving_endpoint_drops_nothing_and_warns_nothing(tmp_path: Path) -> None:
    with receiver() as (received, endpoint):
        # the receiver files each span under its deployment; the SDK's timeout fits its retry of a
        # keep-alive connection the receiver closed
        done, report = _run(tmp_path, endpoint, OTEL_RESOURCE_ATTRIBUTES="deployment.environment.name=ci")
    assert WARNING not in done.stderr, done.stderr
    assert report["spans_dropped"] == 0 and received.spans, (report["spans_dropped"], len(received.spans))
