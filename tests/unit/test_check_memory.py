"""`colocate check`'s memory rows: the host's limits read from a file tree that mimics /proc and
/sys/fs/cgroup (tests/integration/test_check_cgroup.py reads a real cgroup limit), and each row
made to fail for its own reason, its bounds taken from the plan's own numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli.plan.options import PlanOptions
from orchestrator.job.capacity import PROCESS_BYTES
from orchestrator.job.check.host import V1_NO_LIMIT, HostMemory
from orchestrator.job.check.memory import (
    RESIDUE_BYTES,
    Gpu,
    device_rows,
    host_row,
    node_hosts,
    pinned_row,
    slot_peaks,
)
from orchestrator.job.check.rows import Outcome
from orchestrator.plan.writers import node_written, rank_written, stage_writes

H200 = 150_754_820_096
LIMITS = "Max cpu time              unlimited            unlimited            seconds\n"


def mimic(root: Path, files: dict[str, str]) -> Path:
    """A file tree that mimics /proc and /sys/fs/cgroup under `root`."""
    files = {"proc/meminfo": "MemTotal:       24683792 kB\nMemFree: 1 kB\n", **files}
    files.setdefault(
        "proc/self/limits", LIMITS + "Max locked memory         8388608              8388608              bytes\n"
    )
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_v2_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root = mimic(
        tmp_path,
        {
            "proc/self/cgroup": "0::/user.slice/job/step\n",
            "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
            "sys/fs/cgroup/user.slice/memory.max": "max\n",
            "sys/fs/cgroup/user.slice/job/memory.max": "34359738368\n",  # 32 GiB: the tightest
            "sys/fs/cgroup/user.slice/job/step/memory.max": "68719476736\n",
        },
    )
    host = HostMemory.read(root)
    assert (host.cgroup_limit, host.cgroup_file) == (32 << 30, "/sys/fs/cgroup/user.slice/job/memory.max")
    assert host.limit == 32 << 30
    assert host.mem_total == 24683792 * 1024
    assert host.memlock == 8388608


def test_cgroup_v1_in_a_hybrid_mount_and_a_container_view(tmp_path: Path) -> None:
    # This machine's shape: v1 holds the memory controller, v2 is mounted at unified/; the path
    # /proc/self/cgroup names is missing below the mount (a container seeing its cgroup as root).
    root = mimic(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/process_api/53ae\n1:cpu:/\n0::/\n",
            "sys/fs/cgroup/unified/cgroup.controllers": "",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "17179869184\n",
        },
    )
    assert HostMemory.read(root).cgroup_limit == 16 << 30
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(f"{V1_NO_LIMIT + 4095}\n")  # v1's "none"
    host = HostMemory.read(root)
    assert (host.cgroup_limit, host.limit, host.limit_source) == (None, host.mem_total, "MemTotal (no cgroup limit)")


def test_memlock_unlimited_and_no_cgroup_file(tmp_path: Path) -> None:
    root = mimic(
        tmp_path, {"proc/self/limits": "Max locked memory         unlimited            unlimited            bytes\n"}
    )
    host = HostMemory.read(root)
    assert (host.memlock, host.cgroup_limit, host.shm_free) == (None, None, None)  # no /dev/shm in the tree


def test_this_machine_is_read() -> None:
    host = HostMemory.read()
    assert host.mem_total > 0 and host.limit > 0


@pytest.fixture(scope="module")
def qwen() -> PlanOptions:
    return PlanOptions(model="qwen3-4b", tp=2)


def test_no_gpu_is_skipped_never_ok(qwen: PlanOptions) -> None:
    (row,) = device_rows(qwen.plan(), [])
    assert row.outcome is Outcome.SKIPPED and row.read.startswith("no GPU")


def test_a_gpu_with_less_free_than_the_peak_fails(qwen: PlanOptions) -> None:
    p = qwen.plan()
    peak = max(slot_peaks(p), key=lambda x: x.bytes).bytes
    rows = device_rows(p, [Gpu(0, peak - 1, H200), Gpu(1, peak + RESIDUE_BYTES - 1, H200)])
    assert [r.outcome for r in rows] == [Outcome.FAIL, Outcome.WARN]
    assert "GPU 0" in rows[0].read and f"{(H200 - peak + 1) / 1e9:,.2f} GB in use" in (rows[0].fix or "")
    assert "residue" in rows[1].read
    ok = device_rows(p, [Gpu(0, peak + RESIDUE_BYTES, H200)] * 2)
    assert [r.outcome for r in ok] == [Outcome.OK, Outcome.OK]


def test_fewer_gpus_than_a_node_s_ranks_and_another_gpu_size(qwen: PlanOptions) -> None:
    p = qwen.plan()
    rows = device_rows(p, [Gpu(0, 80 * 10**9, 85_000_000_000)])
    assert rows[0].outcome is Outcome.FAIL and "puts 2 ranks on a node" in rows[0].read
    assert "--gpus-per-node 1" in (rows[0].fix or "")
    size = rows[-1]
    assert (size.check, size.outcome, size.fix) == ("GPU size against the plan", Outcome.WARN, "--gpu-memory-gb 85.00")


def test_the_peaks_of_a_node_s_slots_follow_megatron_s_order() -> None:
    # PP=2 on nodes of 2 GPUs: node 0 holds stage 0's two ranks, node 1 stage 1's; each slot's
    # peak is the larger of the two stages'.
    p = PlanOptions(model="qwen3-4b", tp=2, pp=2, gpus_per_node=2).plan()
    stage = [max(d for d, _ in p.phases(r).values()) for r in p.ranks]
    assert [x.bytes for x in slot_peaks(p)] == [max(stage)] * 2


def test_host_limits_each_fail_for_their_own_reason() -> None:
    p = PlanOptions(model="qwen3-4b", tp=2, dp=2, mode="backup").plan()
    (node,) = node_hosts(p)
    assert node.held == sum(h for _, _, h in p.node_totals()) + 4 * PROCESS_BYTES
    need = node.held + node.save
    row = host_row(p, HostMemory(mem_total=node.held - 1), available=need)
    assert row.outcome is Outcome.FAIL and "fewer ranks" in (row.fix or "") and "a save" not in (row.fix or "")
    limited = HostMemory(mem_total=10**15, cgroup_limit=need - 1, cgroup_file="/m/memory.max")
    row = host_row(p, limited, available=need, saves=True)
    assert row.outcome is Outcome.FAIL and "a save would pass" in (row.fix or "") and "/m/memory.max" in row.read
    row = host_row(p, limited, available=need)  # a run not said to save: its save is a warning
    assert row.outcome is Outcome.WARN and "--save-every" in (row.fix or "") and "no --saves" in row.read
    row = host_row(p, HostMemory(mem_total=need), available=need - 1, saves=True)
    assert row.outcome is Outcome.WARN
    assert host_row(p, HostMemory(mem_total=need), available=need, saves=True).outcome is Outcome.OK


def test_pinned_bytes_against_memlock() -> None:
    p = PlanOptions(model="qwen3-4b", tp=2, mode="backup").plan()
    pinned = max(max(h for _, h in p.phases(r).values()) for r in p.ranks)
    assert pinned > 0
    warned = pinned_row(p, HostMemory(mem_total=1, memlock=pinned - 1))
    assert warned.outcome is Outcome.WARN and "ulimit -l unlimited" in (warned.fix or "")
    assert pinned_row(p, HostMemory(mem_total=1, memlock=pinned)).outcome is Outcome.OK
    assert pinned_row(p, HostMemory(mem_total=1, memlock=None)).outcome is Outcome.OK


@pytest.mark.parametrize(
    "layout",
    [
        {"model": "qwen3-4b", "tp": 2, "dp": 2},
        {"model": "qwen3-4b", "tp": 2, "dp": 2, "pp": 2, "gpus_per_node": 2},
        {
            "model": "glm-5",
            "tp": 8,
            "pp": 4,
            "ep": 16,
            "etp": 1,
            "dp": 2,
            "pp_layers": "19,20,20,19",
            "gpus_per_node": 4,
        },
    ],
)
def test_each_tensor_is_staged_on_its_one_writer(layout: dict[str, object]) -> None:
    p = PlanOptions(**layout).plan()  # type: ignore[arg-type]
    writes = [stage_writes(p, s) for s in range(p.parallel.pp)]
    per_rank = [rank_written(p, r, writes) for r in range(p.parallel.world)]
    # The model parts over every rank are the checkpoint's model, each tensor once.
    assert sum(m for m, _ in per_rank) == p.checkpoint_bytes()[0]
    assert sum(node_written(p)) == sum(m + o for m, o in per_rank)
    # A sum of each rank's `checkpoint_written` counts the model once per DP replica.
    naive = sum(
        p.checkpoint_written(p.ranks[r // (p.parallel.world // p.parallel.pp)]) for r in range(p.parallel.world)
    )
    assert sum(node_written(p)) < naive
