"""Telemetry: transition listeners, OpenTelemetry tracing (spans, propagation, OTLP/JSON files), structlog logs."""
