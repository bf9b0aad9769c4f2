"""`colocate diagram` run as a user runs it: the installed console script, in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from states import Phase

ROOT = Path(__file__).resolve().parents[2]
COLOCATE = shutil.which("colocate") or ""


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    command = [COLOCATE] if COLOCATE else [sys.executable, "-m", "orchestrator.cli"]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_mermaid_has_the_five_phases() -> None:
    result = run("diagram", "--format", "mermaid")
    assert result.returncode == 0, result.stderr
    assert "stateDiagram" in result.stdout
    for phase in ("TRAIN", "GRADS_PAUSED", "WEIGHTS_SYNCED", "PARAMS_DROPPED", "ROLLOUT", "FAULTED"):
        assert f'state "{phase}"' in result.stdout
    assert "update_weights [weights_changed & sync_source_resident" in result.stdout


def test_dot_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "lifecycle.dot"
    result = run("diagram", "--format", "dot", "--output", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith('digraph "colocate lifecycle"')
    assert all(phase.value in text for phase in Phase)


def test_docs_are_current() -> None:
    result = run("diagram", "--check", "docs/lifecycle.md")
    assert result.returncode == 0, result.stderr


def test_stale_docs_fail_the_check_and_update_fixes_them(tmp_path: Path) -> None:
    doc = tmp_path / "lifecycle.md"
    doc.write_text((ROOT / "docs/lifecycle.md").read_text().replace("restore [engine_idle", "restore [engine_busy"))
    stale = run("diagram", "--check", str(doc))
    assert stale.returncode == 1 and "is stale" in stale.stderr
    assert run("diagram", "--update", str(doc)).returncode == 0
    assert run("diagram", "--check", str(doc)).returncode == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("diagram", "--format", "png"), "'png' is not one of"),
        (("diagram", "--output", "/nonexistent-dir/x.mmd"), "cannot write /nonexistent-dir/x.mmd"),
        (("diagram", "--check", "no-such-file.md"), "no-such-file.md: no such file"),
        (("diagram", "--check", "README.md"), "no generated block"),
    ],
)
def test_bad_input_is_a_clear_error_and_nonzero_exit(args: tuple[str, ...], words: str) -> None:
    result = run(*args)
    assert result.returncode != 0
    assert words in " ".join(result.stderr.split())
