"""How `colocate` leaves once torch is loaded (a run): without the interpreter's teardown of the
modules, which takes seconds, and with everything Python's exit does before it still done."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("torch")


def test_a_command_that_loaded_torch_exits_without_the_teardown_yet_runs_what_comes_before(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import atexit, sys, threading, time
        import torch

        class Torn:
            def __del__(self):
                print("torn down", flush=True)

        kept = Torn()  # a module's object: collected by the teardown, and only by it
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").close())
        late = lambda: (time.sleep(0.5), open({str(tmp_path / "thread")!r}, "w").close())
        threading.Thread(target=late).start()  # not a daemon: the exit waits for it
        sys.argv = ["colocate", "diagram", "--check", "docs/lifecycle.md"]
        print("unflushed", end="")
        from orchestrator.cli import main
        main()
        """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "diagram is current" in done.stderr
    assert done.stdout == "unflushed", "the streams are flushed, and the modules are not torn down"
    assert (tmp_path / "atexit").exists() and (tmp_path / "thread").exists()
