"""`colocate run --resume` of a checkpoint whose MANIFEST.json is JSON of another shape (issue 42,
item 4): exit 2 with the problem named in the one configuration message, no traceback, before any
rank starts. The checkpoint is sealed by the store itself and then its manifest is damaged."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.adapters.checkpoints import MANIFEST, begin, seal
from tests.support.cli import ROOT, colocate


def _sealed(root: Path) -> Path:
    partial = begin(root, 1)
    (partial / "trainer" / "__0_0.distcp").write_bytes(b"weights")
    (partial / "colocate.json").write_text("{}")
    return Path(seal(partial, root, 1).path)


def _files_as_a_list(m: dict[str, Any]) -> None:
    m["files"] = [{"name": name, **entry} for name, entry in m["files"].items()]


def _an_entry_a_number(m: dict[str, Any]) -> None:
    m["files"]["colocate.json"] = 2


def _an_entry_without_sha256(m: dict[str, Any]) -> None:
    del m["files"]["colocate.json"]["sha256"]


CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "files a list": (_files_as_a_list, "files is a list, not an object of file name to its bytes and sha256"),
    "an entry a number": (_an_entry_a_number, "files['colocate.json'] is a number, not an object of bytes and sha256"),
    "an entry without sha256": (_an_entry_without_sha256, "files['colocate.json']: no 'sha256'"),
}


@pytest.fixture
def temp() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="ci-"))
    yield folder
    for path in sorted(folder.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir()


@pytest.mark.parametrize("case", CASES)
def test_a_manifest_of_another_shape_is_refused_by_name(case: str, temp: Path, tmp_path: Path) -> None:
    damage, problem = CASES[case]
    manifest = _sealed(tmp_path / "ck") / MANIFEST
    listed = json.loads(manifest.read_text())
    damage(listed)
    manifest.write_text(json.dumps(listed))
    env = {**os.environ, "TMPDIR": str(temp)}
    args = colocate("run", "--steps", "3", "--mode", "backup", "--resume", str(tmp_path / "ck"))
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"{manifest}: {problem}" in " ".join(done.stderr.split()), done.stderr
    assert list(temp.iterdir()) == []  # Ray never started
