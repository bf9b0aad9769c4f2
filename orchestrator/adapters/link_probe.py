"""`colocate plan --measure`: the links one GPU can time on its own, measured on it.

A pinned copy each way and a device-to-device copy, each of `gib` GiB, timed with CUDA events
(the median of `repeats` after one warm-up), as `benchmarks/step_overhead.py` times the ceilings
of its phases. NVLink and InfiniBand need a second GPU and a second node: they keep the rates
given. Imported only under `--measure`, so `colocate plan` runs without torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

from orchestrator.errors import ConfigError
from orchestrator.plan.figures import Link, LinkRates


def _median_seconds(work: Callable[[], object], repeats: int) -> float:
    import torch

    work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(given: LinkRates, *, gib: float = 1.0, repeats: int = 5) -> LinkRates:
    """`given` with the pinned copy's rates, each way, and the device copy's measured on this
    machine's first GPU. Raises ConfigError where there is no CUDA device to measure."""
    try:
        import torch
    except ImportError:
        raise ConfigError(["--measure needs torch with CUDA, and torch is not installed here"]) from None
    if not torch.cuda.is_available():
        raise ConfigError(
            ["--measure needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); "
             "leave --measure out to plan with the published H200 rates, or give --pcie-gbps and --device-copy-gbps"]
        )  # fmt: skip
    n = int(gib * 2**30)
    device = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 256)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    other = torch.empty_like(device)
    to_host = _median_seconds(lambda: host.copy_(device, non_blocking=True), repeats)
    from_host = _median_seconds(lambda: device.copy_(host, non_blocking=True), repeats)
    copy = _median_seconds(lambda: other.copy_(device), repeats)
    name = torch.cuda.get_device_name()
    return replace(
        given,
        to_host_gbps=n / to_host / 1e9,
        from_host_gbps=n / from_host / 1e9,
        device_copy_gbps=n / copy / 1e9,
        source=f"measured on {name} ({gib:g} GiB copies, median of {repeats}); NVLink and InfiniBand as given",
        measured=(Link.TO_HOST, Link.FROM_HOST, Link.DEVICE),
    )
