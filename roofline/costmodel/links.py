"""Links between GPUs: the latency-bandwidth (alpha-beta) model of Thakur et al. 2005, ring all-reduce and
point-to-point times, and the interconnect presets (NVLink, PCIe, InfiniBand, Ethernet) with their sources.

``roofline.hardware`` re-exports :data:`INTERCONNECT_PRESETS` and :func:`load_interconnect` beside the device
presets. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from roofline.costmodel.common import _check_count, _check_non_negative, _check_positive

PAPER_THAKUR = ('Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in '
                'MPICH" (IJHPCA 19(1):49-66)')


@dataclass(frozen=True)
class Link:
    """A GPU-to-GPU link in the latency-bandwidth (alpha-beta) model of Thakur et al. 2005.

    Presets with their sources are :data:`INTERCONNECT_PRESETS` (also ``roofline.hardware.INTERCONNECT_PRESETS``).

    Attributes:
        name: preset name or a label.
        bandwidth: bytes/s per direction per GPU (beta = 1 / bandwidth).
        latency_s: seconds per message, i.e. per ring step (alpha).
        citation: where the numbers come from.
    """

    name: str
    bandwidth: float
    latency_s: float
    citation: str = ""

    def __post_init__(self) -> None:
        _check_positive("bandwidth", self.bandwidth)
        _check_non_negative("latency_s", self.latency_s)


def slowest_link(*links: Link) -> Link:
    """The link a ring over all of ``links`` runs at: the least bandwidth and the most latency.

    Every ring step waits for its slowest transfer, so one slow hop sets the pace of the whole group.
    Returns the link itself when one link is slowest on both counts.
    """
    if not links:
        raise ValueError("slowest_link needs at least one link")
    bw = min(x.bandwidth for x in links)
    lat = max(x.latency_s for x in links)
    for x in links:
        if x.bandwidth == bw and x.latency_s == lat:
            return x
    names = "/".join(dict.fromkeys(x.name for x in links))
    return Link(f"{names} (slowest of)", bw, lat, citation="least bandwidth and most latency of: " + names)


def ring_allreduce_time(message_bytes: float, num_ranks: int, bandwidth: float, latency_s: float) -> float:
    """Seconds for a ring all-reduce of ``message_bytes`` over ``num_ranks`` GPUs:
    ``2 (N-1) x latency + 2 (N-1)/N x message_bytes / bandwidth``; 0 for one rank.

    A ring reduce-scatter then a ring all-gather, N-1 steps each, every step sending 1/N of the
    message to the next GPU (Thakur et al. 2005: a ring all-gather costs ``(p-1) alpha + (p-1)/p n
    beta``, a reduce-scatter the same plus the reduction, which is left out here). NCCL's ring uses the
    same 2(N-1) steps (``nsteps`` in ``src/graph/tuning.cc``) and the same ``2 (N-1)/N`` bus-bandwidth
    factor (nccl-tests ``doc/PERFORMANCE.md``). NCCL's fixed per-call base latency (6.6 us for
    Ring/LL in that file) and the kernel launch are left out, which keeps the term on the floor side.
    """
    _check_non_negative("message_bytes", message_bytes)
    _check_count("num_ranks", num_ranks)
    _check_positive("bandwidth", bandwidth)
    _check_non_negative("latency_s", latency_s)
    if num_ranks == 1:
        return 0.0
    n = num_ranks
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * message_bytes / bandwidth


def send_recv_time(message_bytes: float, bandwidth: float, latency_s: float) -> float:
    """Seconds for one point-to-point message: ``latency + message_bytes / bandwidth`` (alpha-beta)."""
    _check_non_negative("message_bytes", message_bytes)
    _check_positive("bandwidth", bandwidth)
    _check_non_negative("latency_s", latency_s)
    return latency_s + message_bytes / bandwidth


def group_link(ranks: Iterable[int], gpus_per_node: int, intra: Link, inter: Link) -> Link:
    """The link governing a group of global ``ranks``: ``intra`` inside one node (rank // gpus_per_node),
    else the slowest of ``intra`` and ``inter`` (:func:`slowest_link`)."""
    _check_positive("gpus_per_node", gpus_per_node)
    nodes = {r // gpus_per_node for r in ranks}
    return intra if len(nodes) <= 1 else slowest_link(intra, inter)


# Links between GPUs for the parallel bound (:class:`Link`): bandwidth per direction per GPU
# from the datasheet or the standard; latency per ring step (one hop) from NCCL's own cost model,
# src/graph/tuning.cc, table hwLat, Ring algorithm, LL protocol (the small-message protocol a decode
# all-reduce uses). NCCL adds a fixed base latency per call (6.6 us, Ring/LL) that these leave out.
_NCCL_HWLAT = "NCCL src/graph/tuning.cc hwLat[{}][Ring][LL] = {} us per ring step"
INTERCONNECT_PRESETS: dict[str, Link] = {
    "nvlink": Link(
        "nvlink", bandwidth=450e9, latency_s=0.6e-6,
        citation="NVIDIA H100 / H200 Tensor Core GPU datasheets: fourth-generation NVLink, 900 GB/s per GPU "
                 "both directions = 450 GB/s each way; " + _NCCL_HWLAT.format("NVLINK", 0.6)),
    "pcie": Link(
        "pcie", bandwidth=64e9, latency_s=1.0e-6,
        citation="PCI-SIG PCI Express 5.0 base specification: 32 GT/s x 16 lanes = 64 GB/s per direction "
                 "(63 GB/s after 128b/130b encoding, about 50 GB/s achieved); " + _NCCL_HWLAT.format("PCI", 1.0)),
    "ib": Link(
        "ib", bandwidth=50e9, latency_s=2.7e-6,
        citation="NVIDIA ConnectX-7 adapter datasheet, InfiniBand NDR: 400 Gb/s = 50 GB/s per port, one "
                 "port per GPU (as in DGX H100); " + _NCCL_HWLAT.format("NET", 2.7)),
    "ethernet": Link(
        "ethernet", bandwidth=12.5e9, latency_s=30e-6,
        citation="IEEE 802.3 100GBASE (100 GbE): 100 Gb/s = 12.5 GB/s; 30 us per step is an estimate for "
                 "NCCL's TCP socket transport, not a datasheet figure (tuning.cc's 2.7 us NET figure "
                 "assumes RDMA)"),
}


def load_interconnect(name: str, bandwidth_gb_s: float | None = None, latency_us: float | None = None) -> Link:
    """An interconnect preset (``nvlink``, ``pcie``, ``ib``, ``ethernet``), with its bandwidth (GB/s,
    1e9 bytes/s per direction per GPU) and latency per ring step (microseconds) overridden if given;
    an override is recorded in the citation.

    Raises:
        ValueError: an unknown name (lists the presets), or an override that is not a finite
            bandwidth > 0 or latency >= 0.
    """
    if name not in INTERCONNECT_PRESETS:
        raise ValueError(f"unknown interconnect {name!r}; known: {', '.join(INTERCONNECT_PRESETS)}")
    link = INTERCONNECT_PRESETS[name]
    given = []
    if bandwidth_gb_s is not None:
        if not (math.isfinite(bandwidth_gb_s) and bandwidth_gb_s > 0):
            raise ValueError(f"link bandwidth must be a finite number of GB/s > 0, got {bandwidth_gb_s}")
        given.append(f"bandwidth {bandwidth_gb_s:g} GB/s")
    if latency_us is not None:
        if not (math.isfinite(latency_us) and latency_us >= 0):
            raise ValueError(f"link latency must be a finite number of microseconds >= 0, got {latency_us}")
        given.append(f"latency {latency_us:g} us per step")
    if not given:
        return link
    return Link(link.name, bandwidth=link.bandwidth if bandwidth_gb_s is None else bandwidth_gb_s * 1e9,
                latency_s=link.latency_s if latency_us is None else latency_us * 1e-6,
                citation=f"given: {', '.join(given)}; preset: {link.citation}")
