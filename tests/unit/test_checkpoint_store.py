"""The checkpoint store: complete only once renamed into place, and every damage refused by file.

The kill during a save is a real SIGKILL of a process sealing a checkpoint large enough to be
caught mid-hash; the previous checkpoint must be the latest, whole, afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.adapters.checkpoints import CheckpointRefused, begin, complete, latest, seal, verify

ROOT = Path(__file__).resolve().parents[2]


def _save(root: Path, step: int, payload: bytes = b"weights") -> Path:
    partial = begin(root, step)
    (partial / "trainer" / "__0_0.distcp").write_bytes(payload)
    (partial / "colocate.json").write_text(f'{{"step": {step}}}')
    return Path(seal(partial, root, step).path)


def test_a_sealed_checkpoint_verifies_and_is_the_latest(tmp_path: Path) -> None:
    first, second = _save(tmp_path, 2), _save(tmp_path, 4)
    assert latest(tmp_path) == second and [s for s, _ in complete(tmp_path)] == [2, 4]
    assert set(verify(first)["files"]) == {"trainer/__0_0.distcp", "colocate.json"}


def test_a_partial_save_is_never_the_latest(tmp_path: Path) -> None:
    saved = _save(tmp_path, 2)
    partial = begin(tmp_path, 4)
    (partial / "colocate.json").write_text("{}")
    assert latest(tmp_path) == saved


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:3]), "3 bytes, the manifest says 7 (truncated or overwritten)"),
        (lambda p: p.write_bytes(b"weighTs"), "its SHA256 differs from the manifest's (damaged)"),
        (lambda p: p.unlink(), "missing"),
    ],
    ids=["truncated", "flipped", "deleted"],
)
def test_damage_is_refused_naming_the_file(tmp_path: Path, damage, words: str) -> None:  # type: ignore[no-untyped-def]
    checkpoint = _save(tmp_path, 2)
    damage(checkpoint / "trainer" / "__0_0.distcp")
    with pytest.raises(CheckpointRefused) as refused:
        verify(checkpoint)
    assert f"{checkpoint / 'trainer' / '__0_0.distcp'}: {words}" in str(refused.value)


def test_a_missing_or_unreadable_manifest_is_refused(tmp_path: Path) -> None:
    checkpoint = _save(tmp_path, 2)
    (checkpoint / "MANIFEST.json").write_text("{not json")
    with pytest.raises(CheckpointRefused, match=r"MANIFEST\.json: unreadable"):
        verify(checkpoint)
    (checkpoint / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointRefused, match=r"MANIFEST\.json: missing: the checkpoint is not complete"):
        verify(checkpoint)


def test_nothing_to_resume_from_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointRefused, match="does not exist"):
        latest(tmp_path / "none")
    begin(tmp_path, 3)
    with pytest.raises(CheckpointRefused, match=r"holds no complete checkpoint .*\.partial-step-000003 never finished"):
        latest(tmp_path)


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    _save(tmp_path, 2, b"old")
    again = _save(tmp_path, 2, b"newer")
    assert (again / "trainer" / "__0_0.distcp").read_bytes() == b"newer"
    verify(again)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


SEALER = """
import sys
from pathlib import Path
from orchestrator.adapters.checkpoints import begin, seal
root = Path(sys.argv[1])
partial = begin(root, 4)
for i in range(8):
    (partial / f"__{i}.distcp").write_bytes(bytes(64 << 20))
print("sealing", flush=True)
seal(partial, root, 4)
"""


def test_a_kill_during_a_save_leaves_the_last_checkpoint_the_latest_and_whole(tmp_path: Path) -> None:
    saved = _save(tmp_path, 2)
    proc = subprocess.Popen(
        [sys.executable, "-c", SEALER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "sealing\n"  # hashing 512 MiB is still to come
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "step-000004").exists(), "the kill came too late to test anything"
    assert latest(tmp_path) == saved
    verify(saved)
    _save(tmp_path, 4)  # the next save of that step clears the leftover
    assert latest(tmp_path).name == "step-000004"
    assert not list(tmp_path.glob(".partial-*"))
