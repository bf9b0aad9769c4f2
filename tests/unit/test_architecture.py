"""The architecture, checked: imports point one way and close no circle, units stay small, the
diagram and the planner need no heavy dependency, and docs/ARCHITECTURE.md draws the layers as
the contract orders them.

The contracts live in pyproject.toml ([tool.importlinter]); `lint-imports` is import-linter's CLI.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import grimp
import pytest

# Small units: modules under 400 lines, classes under 200. A module or class past these is split
# along a seam, not trimmed.
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 200
SIZED_PACKAGES = ("orchestrator", "states", "guards")

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
HEAVY = ("torch", "megatron", "ray", "sglang", "transformers", "torch_memory_saver", "triton")


def _lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def oversized(root: Path) -> list[str]:
    """Every module over MAX_MODULE_LINES and class over MAX_CLASS_LINES (decorators included)."""
    found = []
    for package in SIZED_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text()
            where = path.relative_to(root).as_posix()
            lines = len(source.splitlines())
            if lines > MAX_MODULE_LINES:
                found.append(f"{where}: {lines} lines (module limit {MAX_MODULE_LINES})")
            for node in ast.walk(ast.parse(source, where)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    length = node.end_lineno - start + 1
                    if length > MAX_CLASS_LINES:
                        found.append(f"{where}: class {node.name} {length} lines (class limit {MAX_CLASS_LINES})")
    return found


def test_no_module_and_no_class_is_over_its_limit() -> None:
    found = oversized(ROOT)
    assert not found, "split these along a seam:\n" + "\n".join(found)


def test_the_size_check_names_an_oversized_module_and_class(tmp_path: Path) -> None:
    for package in SIZED_PACKAGES:
        (tmp_path / package).mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))  # with its `class` line, one too many
    (tmp_path / "orchestrator" / "big.py").write_text(f"@dataclass\nclass Big:\n{body}\n")
    (tmp_path / "guards" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "states" / "fits.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert oversized(tmp_path) == [
        f"orchestrator/big.py: class Big {MAX_CLASS_LINES + 2} lines (class limit {MAX_CLASS_LINES})",
        f"guards/long.py: {MAX_MODULE_LINES + 1} lines (module limit {MAX_MODULE_LINES})",
    ]


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


def test_the_acyclic_contract_catches_a_circle_closed_only_under_type_checking(tmp_path: Path) -> None:
    # pyproject's own contract, pointed at a package whose two modules import each other, one of
    # them only for a type: that is a circle too (what workers/ had: staging -> fanout -> staging).
    (acyclic,) = [c for c in PYPROJECT["contracts"] if c["type"] == "acyclic_siblings"]
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fanout.py").write_text("from loop.staging import Slot\n")
    (package / "staging.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loop.fanout import ReplicaSet\nSlot = 1\n"
    )
    contract = acyclic | {"ancestors": ["loop"]}
    settings = {k: v for k, v in PYPROJECT.items() if k != "contracts"} | {"root_packages": ["loop"]}
    lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    lines += ["", "[[tool.importlinter.contracts]]", *(f"{k} = {json.dumps(v)}" for k, v in contract.items())]
    config = tmp_path / "loop.toml"
    config.write_text("[tool.importlinter]\n" + "\n".join(lines) + "\n")
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": str(LINT_IMPORTS.parent)},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No cycles are allowed in loop." in result.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["diagram", "--check", "docs/lifecycle.md"], "diagram is current"), (["plan", "gpu-1b", "--json"], '"gpu-1b"')],
    ids=["diagram", "plan"],
)
def test_diagram_and_plan_run_with_the_heavy_dependencies_unimportable(argv: list[str], says: str) -> None:
    code = textwrap.dedent(f"""
        import importlib.abc, sys

        class Unimportable(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {HEAVY!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, Unimportable())
        sys.argv = ["colocate", *{argv!r}]
        from orchestrator.cli import main
        try:
            main()
        finally:
            print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}), file=sys.stderr)
        """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert says in result.stdout + result.stderr
    assert "loaded: []" in result.stderr


def _layer_picture() -> list[tuple[str, set[str]]]:
    """docs/ARCHITECTURE.md's layers, top to bottom: (name, the parts of layers it says it imports)."""
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = re.search(r"^## Layers\n.*?^```text\n(.*?)^```", page, flags=re.M | re.S)
    assert block, "docs/ARCHITECTURE.md has no ```text picture under ## Layers"
    rows = [re.fullmatch(r"(\S+(?: \| \S+)?)\s{2,}.*→ (.+)", line) for line in block[1].splitlines()]
    assert all(rows), block[1]
    return [(row[1], set(row[2].split()) - {"nothing"}) for row in rows if row]


def _module(part: str) -> str:
    """The module of a layer's part as the picture names it: `core`, `states`."""
    return part if part in ("states", "guards") else f"orchestrator.{part}"


def _part(module: str) -> str:
    """The layer's part `module` is in, as the picture names it; `orchestrator` for the package
    itself (the public API's re-exports, outside the layers)."""
    names = module.split(".")
    return names[1] if names[0] == "orchestrator" and len(names) > 1 else names[0]


def test_the_layer_picture_is_the_contracts_order_and_its_imports_are_the_codes() -> None:
    (layers,) = [c["layers"] for c in PYPROJECT["contracts"] if c["type"] == "layers"]
    contract = [layer.replace("orchestrator.", "") for layer in layers]
    picture = _layer_picture()
    assert [name for name, _ in picture] == contract
    graph = grimp.build_graph(*PYPROJECT["root_packages"])
    for name, said in picture:
        parts = name.split(" | ")
        modules = {m for part in parts for m in {_module(part)} | graph.find_descendants(_module(part))}
        imported = {_part(i) for m in modules for i in graph.find_modules_directly_imported_by(m)} - {
            "orchestrator",
            *parts,
        }
        assert imported == said, f"{name} imports {sorted(imported)}; the picture says {sorted(said)}"
