"""A directory of checkpoints, each complete only once it is renamed into place.

    DIR/step-000012/              complete: MANIFEST.json names every file, its bytes and SHA256
      trainer/                    the trainer's own files (Megatron's dist checkpoint)
      colocate.json               the run's: its step, weight version and what it saves beside
    DIR/.partial-step-000016/     being written: never read, cleared by the next save of that step

A save writes every file under the partial name (`begin`), then `seal` hashes them into the
manifest, flushes files, manifest and directory to disk, and renames the directory into place.
A kill at any moment leaves the last complete checkpoint as it was and the newest one either
whole or absent. `verify` refuses a checkpoint whose manifest is missing or unreadable, or a
file of it missing, shorter or longer, or with other bytes, naming the file.

Nothing here reads what the files hold: the trainer writes its folder, the run its file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.protocols import SavedCheckpoint

MANIFEST = "MANIFEST.json"
TRAINER = "trainer"  # the folder every rank writes its part of the trainer's checkpoint into
RUN_FILE = "colocate.json"
_FORMAT = 1
_COMPLETE = re.compile(r"^step-(\d+)$")
_CHUNK = 8 << 20


class CheckpointRefused(ConfigError):
    """A checkpoint that cannot be resumed from: missing, partial, damaged or of another run."""


def _name(step: int) -> str:
    return f"step-{step:06d}"


def begin(root: Path, step: int) -> Path:
    """The partial directory for the checkpoint of `step`, with its empty `TRAINER` folder (Megatron
    writes into one that exists); a leftover of a killed save of the same step is cleared first."""
    partial = root / f".partial-{_name(step)}"
    if partial.exists():
        shutil.rmtree(partial)
    (partial / TRAINER).mkdir(parents=True)
    return partial


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def seal(partial: Path, root: Path, step: int) -> SavedCheckpoint:
    """Hash every file of `partial` into its manifest, flush it all to disk and rename it into
    place as the complete checkpoint of `step` (one that exists already is replaced whole)."""
    files: dict[str, dict[str, Any]] = {}
    for path in _files(partial):
        _fsync(path)
        files[path.relative_to(partial).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = partial / MANIFEST
    manifest.write_text(json.dumps({"format": _FORMAT, "step": step, "files": files}, indent=1) + "\n")
    _fsync(manifest)
    written = sum(int(entry["bytes"]) for entry in files.values()) + manifest.stat().st_size
    for directory in sorted({p.parent for p in partial.rglob("*")} | {partial}, key=lambda p: -len(p.parts)):
        _fsync(directory)
    final = root / _name(step)
    if final.exists():  # a step saved again (a run resumed from before it): the old one goes once the new is in
        stale = root / f".replaced-{_name(step)}"
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale)
    else:
        partial.rename(final)
    _fsync(root)
    return SavedCheckpoint(path=str(final), files=len(files) + 1, bytes=written)


def complete(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under `root`, by step, oldest first (partial ones are not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _COMPLETE.match(p.name))]
    return sorted(found)


def latest(root: Path) -> Path:
    """The last complete checkpoint under `root`; CheckpointRefused if there is none."""
    found = complete(root)
    if not found:
        partial = sorted(p.name for p in root.glob(".partial-*")) if root.is_dir() else []
        where = f"{root} does not exist" if not root.exists() else f"{root} holds no complete checkpoint (step-N/)"
        also = f"; {', '.join(partial)} never finished" if partial else ""
        raise CheckpointRefused([f"--resume {root}: nothing to resume from: {where}{also}"])
    return found[-1][1]


def verify(checkpoint: Path) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest. CheckpointRefused names each
    file missing, of another size, or with other bytes, and a manifest that is missing or unreadable."""
    manifest = checkpoint / MANIFEST
    try:
        listed = json.loads(manifest.read_text())
        files: dict[str, dict[str, Any]] = listed["files"]
    except FileNotFoundError:
        raise CheckpointRefused([f"{manifest}: missing: the checkpoint is not complete"]) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointRefused([f"{manifest}: unreadable ({type(exc).__name__}: {exc})"]) from None
    problems = []
    for name, entry in files.items():
        path = checkpoint / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif (size := path.stat().st_size) != entry["bytes"]:
            problems.append(f"{path}: {size:,} bytes, the manifest says {entry['bytes']:,} (truncated or overwritten)")
        elif _sha256(path) != entry["sha256"]:
            problems.append(f"{path}: its SHA256 differs from the manifest's (damaged)")
    if problems:
        raise CheckpointRefused(problems)
    return listed
