"""Whether this machine, or the Ray cluster a run attaches to, can hold the ranks asked for.

Judged before any rank starts: without it, a private cluster is started with a CPU slot per
rank whatever the machine has, and `--ranks 128` on 2 cores starts Ray workers until memory
runs out.

What a run takes (`workers.placement`): each rank is a process of its own (a Ray actor) and so
is the engine the job runs, one on the CPU, a replica beside each rank on GPUs; an SGLang engine
runs elsewhere. Ray gives each rank a bundle of one CPU (and one GPU on GPUs), and the CPU
engine a bundle of one CPU more.
"""

from __future__ import annotations

from collections.abc import Mapping

# What each rank or engine process holds in memory of its own at the least: 350 MiB, the USS
# (pages no other process shares) of a `tiny` rank at its peak, measured with psutil on
# 2026-12-02 in `colocate run --steps 5 --ranks 2` (2 cores): ranks 350 and 344 MiB, the
# engine 332 MiB (542, 529 and 513 MiB RSS with the shared libraries). Larger models need more.
PROCESS_BYTES = 350 << 20
GIB = 1 << 30


def machine_problems(ranks: int, *, engine_processes: int, cores: int, available: int) -> list[str]:
    """What keeps a machine of `cores` CPU cores and `available` bytes of memory free from
    holding `ranks` ranks and the engine's processes (`job.preflight` reads both).

    A core per rank: each trains on one thread (`TrainerRank`), all of them at once, while the
    engine computes only when they wait for its rollout. Memory: `PROCESS_BYTES` a process."""
    problems = []
    if ranks > cores:
        problems.append(f"--ranks {ranks}: a rank needs a CPU core of its own, and this machine has {cores}")
    needed = (ranks + engine_processes) * PROCESS_BYTES
    if needed > available:
        problems.append(
            f"--ranks {ranks}: {ranks + engine_processes} processes need {needed / GIB:.1f} GiB of memory at the "
            f"least, and this machine has {available / GIB:.1f} GiB available"
        )
    return problems


def cluster_problems(
    resources: Mapping[str, float], *, address: str, ranks: int, cuda: bool, engine_bundle: bool
) -> list[str]:
    """What keeps the Ray cluster at `address`, with `resources` in all (`ray.cluster_resources()`),
    from holding the run's placement group and processes."""
    where = f"the Ray cluster at {address}"
    cpus = ranks + (engine_bundle and not cuda)
    engine_processes = (ranks if cuda else 1) if engine_bundle else 0
    needed = {"CPU": cpus, "GPU": ranks if cuda else 0, "memory": (ranks + engine_processes) * PROCESS_BYTES}
    problems = []
    for what, why in (
        ("CPU", "a bundle of one CPU per rank" + (", one for the engine" if cpus > ranks else "")),
        ("GPU", "a GPU per rank"),
    ):
        has = resources.get(what, 0.0)
        if needed[what] > has:
            problems.append(f"--ranks {ranks} needs {needed[what]} {what}(s) ({why}), and {where} has {has:g}")
    memory = resources.get("memory")  # Ray's own estimate of what its nodes can give tasks
    if memory is not None and needed["memory"] > memory:
        problems.append(
            f"--ranks {ranks}: {ranks + engine_processes} processes need {needed['memory'] / GIB:.1f} GiB of memory "
            f"at the least, and {where} has {memory / GIB:.1f} GiB"
        )
    return problems
