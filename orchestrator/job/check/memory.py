"""`colocate check`'s memory rows: the plan's peaks against this machine, as it is now.

- **Device**, per visible GPU: the largest peak of the ranks the layout puts on that GPU's slot of
  a node (`Plan.phases`, the engine's weights, KV pool and graphs included) against the memory
  free on it now (`torch.cuda.mem_get_info`), and the GPU's size against the one the plan sized
  the engine's KV pool on (`--gpu-memory-gb`). No GPU: skipped, never passed.
- **Host**, per node: the pinned backups and the optimizer state's arena of the node's ranks
  (`Plan.node_totals`), a process's own memory each (`capacity.PROCESS_BYTES`), and what one
  checkpoint save stages on the node's writers (`plan.writers.node_written`), against the
  process's memory limit (the cgroup's, else MemTotal: `host.HostMemory`), and the memory
  available now.
- **Pinned**, per rank: what it pins against RLIMIT_MEMLOCK where that is not unlimited.

This machine is taken to be one node of the layout; the busiest node is the one judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.job.capacity import PROCESS_BYTES
from orchestrator.job.check.host import HostMemory
from orchestrator.job.check.rows import Outcome, Row, SetUp
from orchestrator.plan.memory import Plan
from orchestrator.plan.writers import node_written

GROUP = "memory"
# What stays in use on a GPU with every region paused, outside any plan: the CUDA context and
# NCCL's communicators, 1.75-2.04 GB measured on an H200 (docs/benchmarks.md, "the residue").
# A peak within this of the free memory fits only if the residue is smaller here.
RESIDUE_BYTES = 2_040_000_000
# --gpu-memory-gb is given to 2 decimals of a GB: a GPU further than this from it is another size.
SIZE_SLACK = 10_000_000


def gb(n: float) -> str:
    """Bytes as the plan prints them, in GB; under 10 MB, in bytes."""
    return f"{n / 1e9:,.2f} GB" if n >= 10_000_000 else f"{int(n):,} bytes"


@dataclass(frozen=True, slots=True)
class Gpu:
    """One visible GPU, as `torch.cuda.mem_get_info` reads it now."""

    index: int
    free: int
    total: int


def gpus_now(count: int) -> list[Gpu]:
    """The free and total memory of each of the `count` visible GPUs (`Machine.gpus`)."""
    if not count:
        return []
    import torch

    return [Gpu(i, *torch.cuda.mem_get_info(i)) for i in range(count)]


@dataclass(frozen=True, slots=True)
class Peak:
    bytes: int
    phase: str
    stage: int


def slot_peaks(p: Plan) -> list[Peak]:
    """For each GPU of a node, the largest device peak of the ranks the layout puts there
    (rank r on GPU r mod gpus_per_node; ranks in Megatron's order, PP outermost)."""
    per_stage = p.parallel.world // p.parallel.pp
    stage_peak = []
    for r in p.ranks:
        phase, (device, _) = max(p.phases(r).items(), key=lambda item: item[1][0])
        stage_peak.append(Peak(device, phase, r.stage))
    slots = min(p.gpus_per_node, p.parallel.world)
    return [
        max((stage_peak[rank // per_stage] for rank in range(slot, p.parallel.world, p.gpus_per_node)), key=_bytes)
        for slot in range(slots)
    ]


def _bytes(peak: Peak) -> int:
    return peak.bytes


def device_rows(p: Plan, gpus: Sequence[Gpu]) -> list[Row]:
    peaks = slot_peaks(p)
    top = max(peaks, key=_bytes)
    if not gpus:
        read = f"no GPU: a rank peaks at {gb(top.bytes)} (stage {top.stage}, at {top.phase}), against nothing here"
        return [Row(group=GROUP, check="device memory per GPU", outcome=Outcome.SKIPPED, read=read)]
    out = []
    if len(gpus) < len(peaks):
        out.append(
            Row(
                group=GROUP,
                check="GPUs for a node's ranks",
                outcome=Outcome.FAIL,
                read=f"the layout puts {len(peaks)} ranks on a node (--gpus-per-node {p.gpus_per_node}); "
                f"this process sees {len(gpus)} GPU(s)",
                fix=f"run on a node with {len(peaks)} GPUs visible (CUDA_VISIBLE_DEVICES), or --gpus-per-node {len(gpus)}",
            )
        )
    for gpu, peak in zip(gpus, peaks, strict=False):
        read = (
            f"GPU {gpu.index}: peak {gb(peak.bytes)} (stage {peak.stage}, at {peak.phase}) against "
            f"{gb(gpu.free)} free now of {gb(gpu.total)}"
        )
        outcome, fix = Outcome.OK, None
        if peak.bytes > gpu.free:
            outcome = Outcome.FAIL
            fix = (
                f"free {gb(gpu.total - gpu.free)} in use on GPU {gpu.index}, or plan less: more TP/PP, "
                "--offload always, a lower --mem-fraction-static"
            )
        elif peak.bytes + RESIDUE_BYTES > gpu.free:
            outcome = Outcome.WARN
            read += f"; less than the {gb(RESIDUE_BYTES)} residue (CUDA context, NCCL) the plan leaves out is spare"
            fix = "leave the residue spare: plan less (more TP/PP, --offload always, a lower --mem-fraction-static)"
        out.append(Row(group=GROUP, check=f"device memory, GPU {gpu.index}", outcome=outcome, read=read, fix=fix))
    sizes = sorted({g.total for g in gpus if abs(g.total - p.engine.device_bytes) > SIZE_SLACK})
    if sizes:
        out.append(
            Row(
                group=GROUP,
                check="GPU size against the plan",
                outcome=Outcome.WARN,
                read=f"the plan sized the engine's KV pool on a {gb(p.engine.device_bytes)} GPU (--gpu-memory-gb); "
                f"this machine's are {', '.join(gb(s) for s in sizes)}",
                fix=f"--gpu-memory-gb {min(sizes) / 1e9:.2f}",
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class NodeHost:
    node: int
    ranks: int
    held: int  # pinned backups and arenas at their peak, and each rank process's own memory
    save: int  # what one checkpoint save stages on the node's writers


def node_hosts(p: Plan) -> list[NodeHost]:
    written = node_written(p)
    out = []
    for (node, _, host), save in zip(p.node_totals(), written, strict=True):
        ranks = min(p.gpus_per_node, p.parallel.world - node * p.gpus_per_node)
        out.append(NodeHost(node, ranks, host + ranks * PROCESS_BYTES, save))
    return out


def host_row(p: Plan, host: HostMemory, *, available: int, saves: bool = False) -> Row:
    """The busiest node's host memory against the limit. What a checkpoint save stages counts
    where the run saves (`saves`: `colocate check --saves`); where it is not said to, a save that
    would pass the limit is a warning, not a failure of a run that may never save."""
    nodes = node_hosts(p)
    busiest = max(nodes, key=lambda n: n.held + n.save)
    with_save, limit = busiest.held + busiest.save, host.limit
    need = with_save if saves else busiest.held
    where = f"node {busiest.node} of {len(nodes)}" if len(nodes) > 1 else "the node"
    save = f" + {gb(busiest.save)} a checkpoint save stages = {gb(with_save)}" if saves else ""
    read = (
        f"{where}: {busiest.ranks} rank(s) hold {gb(busiest.held)} (pinned, arenas, "
        f"{PROCESS_BYTES >> 20} MiB a process){save}, against {gb(limit)}, {host.limit_source}; "
        f"{gb(available)} available now"
    )
    if not saves:
        read += f"; a checkpoint save would stage {gb(busiest.save)} more (no --saves: the run is taken not to save)"
    outcome, fix = Outcome.OK, None
    if busiest.held > limit:
        outcome = Outcome.FAIL
        fix = f"raise the memory limit to {gb(need)}, or put fewer ranks on a node (--gpus-per-node)"
    elif need > limit:
        outcome = Outcome.FAIL
        fix = f"a save would pass the limit: raise it to {gb(need)}, or put fewer ranks on a node (--gpus-per-node)"
    elif need > available:
        outcome = Outcome.WARN
        fix = f"free {gb(need - available)} of host memory others hold now"
    elif with_save > limit:
        outcome = Outcome.WARN
        fix = f"if the run saves (colocate run --save-every), raise the limit to {gb(with_save)} or put fewer ranks on a node"
    return Row(group=GROUP, check="host memory per node", outcome=outcome, read=read, fix=fix)


def pinned_row(p: Plan, host: HostMemory) -> Row:
    """What one rank pins (its mode's backup, and the arena where `default` moves) against
    RLIMIT_MEMLOCK. The regions pin with cudaHostRegister, which the NVIDIA driver does not charge
    to that limit; mlock and RDMA registrations (NCCL over InfiniBand) are charged to it."""
    pinned = max(max(h for _, h in p.phases(r).values()) for r in p.ranks)
    check = "pinned memory against RLIMIT_MEMLOCK"
    if host.memlock is None:
        return Row(group=GROUP, check=check, outcome=Outcome.OK, read=f"a rank pins {gb(pinned)}; memlock unlimited")
    read = f"a rank pins {gb(pinned)}; RLIMIT_MEMLOCK is {gb(host.memlock)}"
    if pinned <= host.memlock:
        return Row(group=GROUP, check=check, outcome=Outcome.OK, read=read)
    read += " (CUDA's pinning is not charged to it; mlock and InfiniBand registrations are)"
    fix = "ulimit -l unlimited (in Docker: --ulimit memlock=-1, as NCCL's docs ask)"
    return Row(group=GROUP, check=check, outcome=Outcome.WARN, read=read, fix=fix)


def judge(p: Plan, *, gpus: Sequence[Gpu], host: HostMemory, available: int, saves: bool = False) -> list[Row]:
    """Every memory row of `p` against what was read."""
    return [*device_rows(p, gpus), host_row(p, host, available=available, saves=saves), pinned_row(p, host)]


def rows(setup: SetUp) -> list[Row]:
    """Read this machine, then judge the plan against it."""
    from orchestrator.job.preflight import Machine  # torch, and the job's config: not on import

    machine = Machine.probe()
    gpus, host = gpus_now(machine.gpus), HostMemory.read()
    return judge(setup.plan, gpus=gpus, host=host, available=machine.available_bytes, saves=setup.saves)
