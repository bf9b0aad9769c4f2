"""The figures the time model starts from, each with where it comes from, in one place: the links'
rates where nothing on the user's machine has measured them (`colocate plan --measure` does), and
the published lifecycle seconds a prediction is printed beside.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from orchestrator.plan.offload import PINNED_COPY_GBPS

# The defaults, their sources in RATE_SOURCES below.
DEVICE_COPY_GBPS = 2100.0
NVLINK_GBPS = 450.0
IB_GBPS = 50.0
PUBLISHED_RATES = "published H200 figures (orchestrator/plan/figures.py)"


class Link(StrEnum):
    """What a rank's bytes cross."""

    TO_HOST = "pinned device->host"
    FROM_HOST = "pinned host->device"
    DEVICE = "device copy"
    NVLINK = "NVLink"
    IB = "InfiniBand"


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkRates:
    """GB/s (1e9 bytes) each link moves for one rank, one way; `source` says where they came from.

    A device copy's rate counts the bytes copied once (it reads them and writes them). NVLink's is
    one GPU's, one direction; InfiniBand's one NIC's, one direction, a NIC a GPU. A collective over
    a group is charged at its slowest member's link, as NCCL's bus bandwidth is."""

    to_host_gbps: float = PINNED_COPY_GBPS
    from_host_gbps: float = PINNED_COPY_GBPS
    device_copy_gbps: float = DEVICE_COPY_GBPS
    nvlink_gbps: float = NVLINK_GBPS
    ib_gbps: float = IB_GBPS
    source: str = PUBLISHED_RATES
    measured: tuple[Link, ...] = ()  # the links a probe measured on this machine

    def gbps(self, link: Link) -> float:
        return {
            Link.TO_HOST: self.to_host_gbps,
            Link.FROM_HOST: self.from_host_gbps,
            Link.DEVICE: self.device_copy_gbps,
            Link.NVLINK: self.nvlink_gbps,
            Link.IB: self.ib_gbps,
        }[link]

    def problems(self) -> list[str]:
        return [
            f"the {link} rate must be a positive GB/s, got {self.gbps(link)}" for link in Link if self.gbps(link) <= 0
        ]


# Where each default rate comes from.
RATE_SOURCES: dict[Link, str] = {
    # docs/benchmarks.md, "The step on one GPU" (2026-12-01): a pinned copy measured 55.1-55.2 GB/s
    # each way on one H200; the plan takes 50, below it, for the offload price and the time alike
    # (the phases that ran on it reached 49.0 and 39.6 GB/s). `--pcie-gbps` or `--measure` replace it.
    Link.TO_HOST: "50 GB/s: one H200's pinned copy measured 55.1-55.2 GB/s (docs/benchmarks.md, 2026-12-01), 50 taken",
    Link.FROM_HOST: "50 GB/s: as device->host",
    # docs/benchmarks.md, "Weight sync" and "The step on one GPU": a device-to-device copy on one
    # H200 measured 2.09-2.12 TB/s of bytes copied (1.00 / 0.98 ms for 2.08 GB; 2.10 TB/s in
    # step_llama-1b.*.h200.json). A measured figure, so the published HBM3e 4.8 TB/s (read + write,
    # halved: 2.4 TB/s copied) is not used.
    Link.DEVICE: "2,100 GB/s copied: one H200 measured 2.09-2.12 TB/s (docs/benchmarks.md, 2026-12-01)",
    # NVIDIA's H200 SXM datasheet: NVLink 900 GB/s per GPU, both directions together.
    Link.NVLINK: "450 GB/s: NVLink 4 on H200 SXM, 900 GB/s both ways (NVIDIA H200 datasheet), one way",
    # InfiniBand NDR (ConnectX-7, one a GPU in a DGX H200): 400 Gb/s a port.
    Link.IB: "50 GB/s: InfiniBand NDR 400 Gb/s, one NIC a GPU (NVIDIA DGX H200 datasheet)",
}


@dataclass(frozen=True, slots=True)
class Published:
    """A lifecycle phase's seconds as a published source states them, at its own scale."""

    model: str  # the preset whose layout it is printed beside
    phase: str  # the time model's phase name
    seconds: float
    what: str
    source: str


PUBLISHED: tuple[Published, ...] = (
    Published(
        "glm-5",
        "restore",
        4.8,
        "the seed's wake-up, GLM-5.2 (744 B)",
        "issue 40",
    ),
    Published(
        "glm-5",
        "update_weights",
        73.8,
        "the seed's colocated full-weight update, GLM-5.2 on 64 GB300 (76.3 -> 73.8 s)",
        "issue 40; the seed",
    ),
)


def published(model: str) -> dict[str, Published]:
    """The published figures for a model, by phase."""
    return {f.phase: f for f in PUBLISHED if f.model == model}
