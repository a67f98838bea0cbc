"""Clusters: nodes x devices per node, joined by an intra-node and an inter-node link.

Units: seconds for ``alpha_s``, bytes/s for ``bw_bytes_per_s``.

A :class:`Link`'s bandwidth is the *per-device, one-direction* bandwidth a device
gets on that link class while every device of its node uses the link at the same
time (which is what happens in SPMD collectives: all groups of a mesh axis run at
once). Presets derive it from the marketed figures:

* NVLink figures are quoted bidirectional per GPU (V100: 300 GB/s, H100: 900 GB/s);
  a ring sends one way on each hop, so the link gets half.
* InfiniBand figures are quoted per direction. A node's total is split over its
  devices (8 x 400 Gb/s on a DGX H100 = one 50 GB/s NIC per GPU; PrimePar's
  100 GB/s per 4-V100 node = 25 GB/s per GPU).

Latencies (alpha) are typical per-hop NCCL figures: a few microseconds inside a node,
~10 us across InfiniBand.

A collective spreads over all of a device's links; a P2P to one neighbour (a ring step's
transfer) gets only the links to that peer: ``intra_peer`` where that is less than
``intra`` (None: a switch gives one peer the whole bandwidth, as NVSwitch does on a DGX
H100). On a 4-V100 node each GPU's six NVLink2 links (25 GB/s per direction each) join it
fully to the other three, two links each: 50 GB/s per direction to one peer, against
150 GB/s for a collective (NVIDIA Tesla V100 whitepaper's link figures; the two-links-per-
pair wiring of a fully connected 4-GPU board, a named assumption).

Overlap and synchronisation figures: ``overlap_slowdown``, how much slower compute runs
beside an asynchronous collective (a parameter's: gradient buckets, ZeRO gathers;
``cost_models.overlap``; None: the published GPU figure there); ``ring_overlap_slowdown``,
the same beside a ring step's P2P, which every rank waits on at each step (None: the
same figure); ``grid_overlap_slowdown``, the same beside a P(2^k x 2^k) op's steps, whose
blocks go to two grid neighbours at once and whose backward hides two transfers behind
its last GEMMs (None: ``ring_overlap_slowdown``); ``ring_step_overhead_s``, what one step of a ring schedule costs beyond its
GEMM and its P2P (launching the step's kernels and waiting on its transfer); and
``collective_sync_s``, what a blocking collective on the critical path (an activation's
reshard) costs beyond its isolated time because the ranks reach it at different moments
(0 on the presets: their alpha is the collective's whole latency, no straggler is
modelled, a named assumption); ``ring_sync_s``, the same for a transfer that runs right
after a ring op's backward (the gradient relaid out of a P(2^k x 2^k) op's skewed input
layout), where the ranks met at the ring's last exchange one step of GEMM before,
not a whole stretch of compute (None: ``collective_sync_s``); ``collective_sync_compute_s``,
the compute after which ``collective_sync_s`` was measured (the typical rank's, in
``calibrate``'s blocking probe; None: unknown), through which a collective that runs a
known, short compute after the ranks last met is charged the square-root law of that
compute (``CostModel.blocking``). A calibration profile measures all seven on its machine;
the presets name theirs below.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .devices import DeviceSpec, get_device

# A guess, named: one ring step launches a GEMM and a send/receive pair and waits on an
# event. NVIDIA's Nsight Systems guide measures a PyTorch kernel's launch round trip at about
# 20 us on a V100 (as quoted in "Every CUDA Kernel Pays a Launch Tax", groundy.com); the
# step's kernels queue behind each other, so one such round trip per step.
RING_STEP_OVERHEAD_S = 20e-6

# The share of a device's memory a plan may fill by default, leaving the rest to the caching
# allocator's fragmentation, the CUDA context and library workspaces. From the 4D-parallelism
# memory estimator paper (arXiv 2411.06465): over 454 runs on A100/H100, no configuration
# whose estimate was at or below 80% of device memory ran out of memory.
USABLE_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class Link:
    """alpha-beta link: sending n bytes costs ``alpha_s + n / bw_bytes_per_s`` seconds."""

    alpha_s: float
    bw_bytes_per_s: float

    def __post_init__(self):
        if self.alpha_s < 0 or self.bw_bytes_per_s <= 0:
            raise ValueError(f"Link needs alpha_s >= 0 and bw_bytes_per_s > 0, got {self}")

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte (1 / bandwidth)."""
        return 1.0 / self.bw_bytes_per_s

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` over this link once."""
        return self.alpha_s + nbytes / self.bw_bytes_per_s


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices.

    ``collective_links`` is filled only by a calibration profile: the alpha-beta fitted
    separately for each collective kind (``"all_gather"``, ``"reduce_scatter"``,
    ``"all_reduce"``, ``"all_to_all"``, ``"p2p"``) on the intra-node link, because a
    backend's algorithms differ per collective (gloo does not run every collective as a
    ring). Collectives it does not name use ``intra``. ``collective_bands`` (also only
    from a profile) refines that per message size: kind -> ((upper_nbytes, alpha_s,
    bw_bytes_per_s), ...), and (kind, n) -> the same for groups of ``n`` ranks smaller than
    the node, measured on such groups, see :mod:`profile`.
    """

    name: str
    device: DeviceSpec
    nodes: int
    devices_per_node: int
    intra: Link
    inter: Link
    collective_links: dict = field(default_factory=dict, hash=False, compare=False)
    collective_bands: dict = field(default_factory=dict, hash=False, compare=False)
    overlap_slowdown: float | None = None
    ring_step_overhead_s: float = RING_STEP_OVERHEAD_S
    ring_overlap_slowdown: float | None = None
    grid_overlap_slowdown: float | None = None
    collective_sync_s: float = 0.0
    ring_sync_s: float | None = None
    collective_sync_compute_s: float | None = None
    usable_memory_fraction: float = USABLE_MEMORY_FRACTION
    intra_peer: Link | None = None   # one neighbour's share of the intra-node links (None: all of them)
    # Extra copies of an all-gather's output the backend allocates while it is in flight:
    # gloo's all_gather_into_tensor gathers into a buffer of its own and copies out (seen as
    # ``gloo:all_gather > aten::empty`` at the fidelity bench's measured backward peak), NCCL
    # writes in place. ``MemoryModel.regathered_bytes``.
    gather_staging: int = 0

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"Cluster {self.name!r}: nodes and devices_per_node must be >= 1")
        if self.ring_step_overhead_s < 0 or self.collective_sync_s < 0 or any(
                x is not None and x < 0 for x in (self.overlap_slowdown, self.ring_overlap_slowdown,
                                                  self.grid_overlap_slowdown, self.ring_sync_s)) or (
                self.collective_sync_compute_s is not None and self.collective_sync_compute_s <= 0):
            raise ValueError(f"Cluster {self.name!r}: overlap_slowdown, ring_overlap_slowdown, "
                             f"grid_overlap_slowdown, ring_step_overhead_s, collective_sync_s and ring_sync_s "
                             f"must be >= 0, collective_sync_compute_s > 0")
        if not 0 < self.usable_memory_fraction <= 1:
            raise ValueError(f"Cluster {self.name!r}: usable_memory_fraction must be in (0, 1], "
                             f"got {self.usable_memory_fraction}")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def default_budget_bytes(self) -> float:
        """The per-device memory budget a plan gets when none is given: the device's memory
        times ``usable_memory_fraction`` (the allocator's headroom, ``USABLE_MEMORY_FRACTION``)."""
        return self.device.mem_bytes * self.usable_memory_fraction


def _nvlink(bidirectional_gb_s: float) -> float:
    return bidirectional_gb_s * 1e9 / 2


CLUSTERS: dict[str, Cluster] = {
    # PrimePar's testbed: 8 nodes x 4 V100-32GB, NVLink 300 GB/s, InfiniBand 100 GB/s per node.
    "primepar-v100": Cluster("primepar-v100", get_device("V100-32GB"), nodes=8, devices_per_node=4,
                             intra=Link(5e-6, _nvlink(300)), inter=Link(10e-6, 100e9 / 4),
                             intra_peer=Link(5e-6, 2 * 25e9)),
    # DGX H100 nodes: 8 x H100, NVLink4 900 GB/s, 8 x 400 Gb/s ConnectX-7 (one per GPU).
    # 8 nodes = 64 GPUs; a mesh may use fewer devices than the cluster has.
    "dgx-h100": Cluster("dgx-h100", get_device("H100-SXM"), nodes=8, devices_per_node=8,
                        intra=Link(3e-6, _nvlink(900)), inter=Link(10e-6, 8 * 400e9 / 8 / 8)),
    # This machine: 4 gloo ranks over loopback TCP. Rough guesses; `python -m stpc calibrate`
    # writes a measured profile to use instead.
    "cpu-local": Cluster("cpu-local", get_device("CPU"), nodes=1, devices_per_node=4,
                         intra=Link(50e-6, 2e9), inter=Link(50e-6, 2e9), gather_staging=1),
}
