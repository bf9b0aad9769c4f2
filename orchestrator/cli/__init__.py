"""The `colocate` command line: typer commands, and reading the trace files they write."""

from orchestrator.cli.app import app, main

__all__ = ["app", "main"]
