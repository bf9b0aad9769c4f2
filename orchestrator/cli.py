"""The `colocate` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator import diagram

app = typer.Typer(
    name="colocate",
    help="Lifecycle controller for colocated RL post-training (Megatron-core trainer + rollout engine).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)  # never break a path or command across lines


@app.callback()
def _root() -> None:
    """Lifecycle controller for colocated RL post-training."""


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.command("diagram")
def diagram_command(
    fmt: Annotated[diagram.Format, typer.Option("--format", "-f", help="Diagram language.")] = diagram.Format.MERMAID,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
    check: Annotated[
        Path | None, typer.Option("--check", help="Exit 1 if this document's generated diagram is stale.")
    ] = None,
    update: Annotated[Path | None, typer.Option("--update", help="Rewrite this document's generated diagram.")] = None,
) -> None:
    """Render the lifecycle's state diagram from the transition table."""
    for document in (check, update):
        if document is not None and not document.is_file():
            _fail(f"{document}: no such file")
    try:
        if check is not None:
            if not diagram.check_document(check.read_text()):
                _fail(f"{check} is stale: run `colocate diagram --update {check}`")
            err.print(f"{check}: diagram is current")
            return
        if update is not None:
            update.write_text(diagram.update_document(update.read_text()))
            err.print(f"{update}: diagram updated")
            return
        text = diagram.render(fmt)
        if output is None:
            typer.echo(text, nl=False)
        else:
            output.write_text(text)
    except ValueError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {exc.filename or output}: {exc.strerror}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
