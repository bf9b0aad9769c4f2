"""A directory of checkpoints, each complete only once it is renamed into place.

    DIR/step-000012/              complete: MANIFEST.json names every file, its bytes and SHA256
      trainer/                    the trainer's own files (Megatron's dist checkpoint)
      colocate.json               the run's: its step, weight version and what it saves beside
    DIR/.partial-step-000016/     being written: never read, cleared by the next save of that step

A save writes every file under the partial name (`begin`), then `seal` hashes them into the
manifest, flushes files, manifest and directory to disk, and renames the directory into place.
A kill at any moment leaves the last complete checkpoint as it was and the newest one either
whole or absent. `verify` refuses a checkpoint whose manifest is missing, unreadable or of
another shape than the one `seal` writes (`check_manifest` names what is wrong with it), or a
file of it missing, shorter or longer, or with other bytes, naming the file.

The manifest, as data:

    {"format": 1, "step": 12, "files": {"colocate.json": {"bytes": 4096, "sha256": "<64 hex>"}, ...}}

`format` is 1; `step` a whole number >= 0; `files` an object whose keys are relative paths inside
the checkpoint (no `..`, not absolute, not the manifest itself) and whose values hold exactly
`bytes` (a whole number >= 0) and `sha256` (64 lowercase hex digits).

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
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ENTRY = ("bytes", "sha256")


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


def _count(value: object) -> bool:
    """A whole number >= 0 as JSON holds one (true and false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _kind(value: object) -> str:
    """The JSON name of `value`'s type, for messages."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)


def _path_problem(name: str) -> str | None:
    parts = name.split("/")
    if not name or "\x00" in name or "\\" in name:
        return "not a file name"
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return "not a plain relative path inside the checkpoint"
    if name == MANIFEST:
        return "the manifest cannot list itself"
    return None


def check_manifest(listed: object, where: Path | str = MANIFEST) -> dict[str, Any]:
    """`listed` (a parsed MANIFEST.json) if it has the shape `seal` writes (the module's docstring);
    else CheckpointRefused naming, at `where`, every way it differs."""
    if not isinstance(listed, dict):
        raise CheckpointRefused([f"{where}: {_kind(listed)}, not an object of format, step and files"])
    problems = []
    if unknown := sorted(set(listed) - {"format", "step", "files"}):
        problems.append(f"{where}: unknown keys {', '.join(map(_shown, unknown))}")
    for key in ("format", "step", "files"):
        if key not in listed:
            problems.append(f"{where}: no {key!r}")
    if "format" in listed and (listed["format"] != _FORMAT or isinstance(listed["format"], bool)):
        problems.append(f"{where}: format {_shown(listed['format'])}; this colocate reads format {_FORMAT}")
    if "step" in listed and not _count(listed["step"]):
        problems.append(f"{where}: step is {_shown(listed['step'])}, not a whole number >= 0")
    files = listed.get("files", {})
    if not isinstance(files, dict):
        problems.append(f"{where}: files is {_kind(files)}, not an object of file name to its bytes and sha256")
        files = {}
    for name, entry in files.items():
        at = f"{where}: files[{_shown(name)}]"
        if (bad := _path_problem(name)) is not None:
            problems.append(f"{at}: {bad}")
        if not isinstance(entry, dict):
            problems.append(f"{at} is {_kind(entry)}, not an object of bytes and sha256")
            continue
        if extra := sorted(set(entry) - set(_ENTRY)):
            problems.append(f"{at}: unknown keys {', '.join(map(_shown, extra))}")
        problems += [f"{at}: no {key!r}" for key in _ENTRY if key not in entry]
        if "bytes" in entry and not _count(entry["bytes"]):
            problems.append(f"{at}: bytes is {_shown(entry['bytes'])}, not a whole number >= 0")
        if "sha256" in entry and not (isinstance(entry["sha256"], str) and _SHA256.match(entry["sha256"])):
            problems.append(f"{at}: sha256 is {_shown(entry['sha256'])}, not 64 lowercase hex digits")
    if problems:
        raise CheckpointRefused(problems)
    return listed


def verify(checkpoint: Path) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest. CheckpointRefused names each
    file missing, of another size, or with other bytes, and a manifest that is missing, unreadable
    or of another shape (`check_manifest`)."""
    manifest = checkpoint / MANIFEST
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        raise CheckpointRefused([f"{manifest}: missing: the checkpoint is not complete"]) from None
    except (OSError, ValueError) as exc:  # ValueError: bytes that are not UTF-8
        raise CheckpointRefused([f"{manifest}: unreadable ({type(exc).__name__}: {exc})"]) from None
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON, or nested deeper than the parser goes
        raise CheckpointRefused([f"{manifest}: unreadable ({type(exc).__name__}: {exc})"]) from None
    listed = check_manifest(parsed, manifest)
    problems = []
    for name, entry in listed["files"].items():
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
