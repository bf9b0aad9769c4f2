"""The architecture, checked: imports point one way, and the diagram needs no heavy dependency.

The contracts live in pyproject.toml ([tool.importlinter]); `lint-imports` is import-linter's CLI.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
HEAVY = ("torch", "megatron", "ray", "sglang", "transformers", "torch_memory_saver", "triton")


def _lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_import_contracts_in_pyproject_are_kept() -> None:
    result = _lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_contract_catches_an_import_against_the_layers(tmp_path: Path) -> None:
    # The same tool over the same tree with the layers upside down: it must find the real imports.
    config = tmp_path / "upside_down.toml"
    config.write_text(
        textwrap.dedent("""
        [tool.importlinter]
        root_packages = ["states", "guards", "orchestrator"]

        [[tool.importlinter.contracts]]
        name = "upside down"
        type = "layers"
        layers = ["states", "orchestrator.cli"]
        """)
    )
    result = _lint_imports("--config", str(config))
    assert result.returncode == 1, result.stdout
    assert "orchestrator.cli is not allowed to import states" in " ".join(result.stdout.split())


def test_colocate_diagram_runs_with_the_heavy_dependencies_unimportable() -> None:
    code = textwrap.dedent(f"""
        import importlib.abc, sys

        class Unimportable(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {HEAVY!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, Unimportable())
        sys.argv = ["colocate", "diagram", "--check", "docs/lifecycle.md"]
        from orchestrator.cli import main
        try:
            main()
        finally:
            print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
        """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "diagram is current" in result.stderr
    assert "loaded: []" in result.stdout
