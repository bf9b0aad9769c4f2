"""Trace files read back: a typed span model (`model`), a per-phase summary (`summary`), and a
picture of one step (`timeline`, imported on its own: it needs matplotlib)."""

from orchestrator.cli.traces.model import (
    FORMATS,
    SPARK_STEPS,
    Span,
    Step,
    Traces,
    Value,
    load,
    read_file,
    trace_files,
)
from orchestrator.cli.traces.summary import PhaseSummary, Summary, percentile, summarize, summary_line, summary_table

__all__ = [
    "FORMATS",
    "SPARK_STEPS",
    "PhaseSummary",
    "Span",
    "Step",
    "Summary",
    "Traces",
    "Value",
    "load",
    "percentile",
    "read_file",
    "summarize",
    "summary_line",
    "summary_table",
    "trace_files",
]
