"""The run's output paths (`--report`, `--log`, `--trace-dir`), tried before any rank starts.

A permission check (`os.access`) says yes to root for anything, /proc and /sys included, and
says nothing of a device that refuses every write. So each output is opened for writing, and
written, as the run will, and nothing of the trial is left behind:

- a file that does not exist yet is created, given one byte and removed. A folder of
  `--trace-dir` that does not exist yet is created, a file is written and removed in it, and the
  folder is removed again;
- an existing file is opened for writing without truncation, and written zero bytes: its content
  and times are left as they were. A device that refuses every write (/dev/full) refuses that
  too. A full file system under an existing regular file is found only when the run writes it
  (for the report, that is said in one line at the end and the exit code is 1);
- `--report` replaces the file at the end with the whole report, so it must be a regular file;
- `--log` appends a line per transition, so a terminal or a pipe (`/dev/stderr`, `/dev/stdout`)
  may take it as well as a regular file. A named pipe must already have a reader; a block device
  or a socket is refused.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

PROBE_PREFIX = ".colocate-probe-"  # a file of a trial in a folder, removed at once


def output_problems(
    *, report: Path | None, log: Path | None, trace_dir: Path | None, save_dir: Path | None = None
) -> list[str]:
    """Every output path that cannot be written, each named with its option and the OS's reason:
    a run must not end after its work only to lose the report."""
    found = [
        _file_problem("--report", report, appended=False) if report is not None else None,
        _file_problem("--log", log, appended=True) if log is not None else None,
        _folder_problem("--trace-dir", trace_dir) if trace_dir is not None else None,
        _folder_problem("--save-dir", save_dir) if save_dir is not None else None,
    ]
    if report is not None and log is not None and report.resolve() == log.resolve():
        found.append(f"--report and --log name the same file, {report}")
    return [problem for problem in found if problem is not None]


def _file_problem(option: str, path: Path, *, appended: bool) -> str | None:
    """Why `path` cannot be written as the file of `option`, or None. `appended`: the run adds
    lines to it (a terminal or a pipe will do); else it writes the file whole."""
    if path.is_dir():
        return f"{option} {path}: is a folder; name a file"
    if not path.parent.is_dir():
        return f"{option} {path}: folder {path.parent} does not exist"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return _written(option, path, lambda: _try_new_file(path))
    except OSError as exc:
        return f"{option} {path}: {exc.strerror}"
    if not stat.S_ISREG(mode) and not (appended and (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode))):
        kinds = "a regular file, a terminal or a pipe" if appended else "a regular file"
        return f"{option} {path}: not {kinds}"
    return _written(option, path, lambda: _try_existing(path))


def _folder_problem(option: str, path: Path) -> str | None:
    """Why `path` cannot be (or be made) a folder to write files in, or None."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "exists and is not a folder" if existing == path else f"{existing} is a file, not a folder"
        return f"{option} {path}: {what}"
    return _written(option, path, lambda: _try_folder(path, existing))


def _written(option: str, path: Path, attempt: Callable[[], None]) -> str | None:
    """None if `attempt` wrote at `path`, else why not, in the OS's words."""
    try:
        attempt()
    except OSError as exc:
        return f"{option} {path}: cannot write there: {exc.strerror or exc}"
    return None


def _try_new_file(path: Path) -> None:
    """Create `path`, write a byte to it (a full device or file system refuses it) and remove it."""
    _write_and_remove(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), path)


def _write_and_remove(fd: int, path: Path | str) -> None:
    try:
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def _try_existing(path: Path) -> None:
    """Open `path` for writing as it is (no truncation; no wait for a named pipe's reader) and
    write nothing to it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    try:
        os.write(fd, b"")
    finally:
        os.close(fd)


def _try_folder(path: Path, existing: Path) -> None:
    """Make `path` below `existing`, write a file in it, then remove the file and every folder made."""
    made: list[Path] = []
    try:
        for folder in reversed([path, *path.parents][: len(path.parts) - len(existing.parts)]):
            folder.mkdir()
            made.append(folder)
        _write_and_remove(*tempfile.mkstemp(prefix=PROBE_PREFIX, dir=path))
    finally:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
