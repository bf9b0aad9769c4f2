"""`python -m orchestrator.cli`: the same as the `colocate` command."""

from orchestrator.cli.app import main

main()
