"""Communication cost (alpha-beta, ring algorithms) and the :class:`CostModel` facade.

Units: every method returns seconds; every size is in bytes.

Ring formulas for a group of ``n`` devices on a link (alpha s, beta = 1/bandwidth s/B),
where ``N`` is the size of the FULL tensor (the gathered result of an all-gather, the
input of a reduce-scatter / all-reduce):

    all_gather(N)     = (n-1) alpha + (n-1)/n * N * beta        each rank receives (n-1)/n of N
    reduce_scatter(N) = (n-1) alpha + (n-1)/n * N * beta
    all_reduce(N)     = 2 (n-1) alpha + 2 (n-1)/n * N * beta    reduce-scatter + all-gather
    all_to_all(N)     = (n-1) alpha + (n-1)/n * (N/n) * beta    each rank holds N/n, keeps 1/n of it
    p2p(N)            = alpha + N * beta                        one neighbour transfer, on the
                                                                links to that peer (Cluster.intra_peer)

A parameter's collectives ride in coalesced messages (``coalesced``): the latency of a
message is shared by its parameters in proportion to their bytes.

Mesh convention: ranks are laid out row-major over ``mesh_shape``, the LAST axis
innermost. Axis ``i``'s groups have stride ``s = prod(mesh_shape[i+1:])`` and size
``n = mesh_shape[i]``. With ``D`` devices per node, a group stays in one node iff
``s*n <= D`` and ``D % (s*n) == 0`` (otherwise some group straddles a node boundary).

Hierarchical groups (crossing nodes). Each node then holds ``n_in = D // s`` members of
a group (1 when ``s >= D``) and the group spans ``n_out = n / n_in`` nodes. A
reduce-scatter runs as an intra-node reduce-scatter of N over n_in ranks followed by an
inter-node reduce-scatter of N/n_in over n_out ranks (all-gather is the reverse):

    T = (n_in-1) a_i + (n_in-1)/n_in * N b_i  +  (n_out-1) a_o + (n_out-1)/n_out * (N/n_in) b_o

Written as one ring over n ranks this is an effective link (:meth:`CostModel.axis_link`)

    alpha_eff = [(n_in-1) a_i + (n_out-1) a_o] / (n-1)
    beta_eff  = n/(n-1) * [(n_in-1)/n_in * b_i + (n_out-1)/(n_out n_in) * b_o]

each clamped from below by the intra-node value, so a group that crosses nodes is never
modelled as cheaper than the same group inside one node. All-to-all does not shrink
its data between stages, so it pays its own off-node share: per rank, (n - n_in)/n of
its N/n bytes cross nodes. P2P along a crossing axis pays the inter-node link: the ring
step is as slow as its slowest hop.

A calibration profile may carry per-collective, per-message-size alpha-beta bands
(``Cluster.collective_bands``), for the whole node and for each smaller group size it
measured; they apply to groups inside one node, the only kind a profile measures: an
axis's group size picks its own bands where there are some, else the node's.
"""
from __future__ import annotations

import math
from bisect import bisect_left

from .cluster import Cluster, Link
from .compute import COPY_OP, batched_weight_time, collective_output_bytes, fresh_alloc_time, gemm_time, roofline
from .overlap import OVERLAP_COMPUTE_SLOWDOWN, exposed

# The message a data-parallel gradient rides in: the runtime's bucket (``stpc.compile``'s
# default ``bucket_mb``, which is DDP's default ``bucket_cap_mb`` of 25 MiB).
GRAD_BUCKET_BYTES = 25 * 2**20

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


class CostModel:
    """Costs on ``cluster`` for a device mesh of ``mesh_shape`` (row-major, last axis
    innermost). All methods return seconds as plain floats and are cheap enough to call
    many thousands of times (per-axis constants are precomputed here)."""

    def __init__(self, cluster: Cluster, mesh_shape: tuple[int, ...],
                 overlap_slowdown: float | None = None):
        mesh_shape = tuple(int(x) for x in mesh_shape)
        if not mesh_shape or any(x < 1 for x in mesh_shape):
            raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape}")
        if math.prod(mesh_shape) > cluster.num_devices:
            raise ValueError(f"mesh {mesh_shape} needs {math.prod(mesh_shape)} devices but cluster "
                             f"{cluster.name!r} has {cluster.num_devices}")
        self.cluster = cluster
        self.mesh_shape = mesh_shape
        # see ``overlap``: compute slowdown beside a collective; the cluster's measured one
        # (``calibrate``), else the published figure
        if overlap_slowdown is None:
            overlap_slowdown = cluster.overlap_slowdown
        self.overlap_slowdown = OVERLAP_COMPUTE_SLOWDOWN if overlap_slowdown is None else float(overlap_slowdown)
        self.ring_step_overhead_s = cluster.ring_step_overhead_s
        self.ring_overlap_slowdown = (self.overlap_slowdown if cluster.ring_overlap_slowdown is None
                                      else float(cluster.ring_overlap_slowdown))
        self.grid_overlap_slowdown = (self.ring_overlap_slowdown if cluster.grid_overlap_slowdown is None
                                      else float(cluster.grid_overlap_slowdown))
        self.collective_sync_s = cluster.collective_sync_s
        self.ring_sync_s = cluster.collective_sync_s if cluster.ring_sync_s is None else cluster.ring_sync_s
        self.collective_sync_compute_s = cluster.collective_sync_compute_s
        self.device = cluster.device
        D = cluster.devices_per_node
        self._axes = []  # per axis: (n, crosses, n_in, n_out)
        for i, n in enumerate(mesh_shape):
            s = math.prod(mesh_shape[i + 1:])
            crosses = s * n > D or D % (s * n) != 0
            if crosses and s < D and D % s == 0 and n % (D // s) == 0:
                n_in = D // s
            elif crosses:
                n_in = 1  # irregular layout: assume every hop leaves the node (pessimistic)
            else:
                n_in = n
            self._axes.append((n, crosses, n_in, n // n_in))
        # (axis, kind) -> (alpha_eff, beta_eff); filled lazily, pure floats afterwards.
        self._eff: dict[tuple[int, str], tuple[float, float]] = {}
        # kind or (kind, group size) -> (sorted band upper bounds, [(alpha, beta), ...]) from a
        # calibration profile.
        self._bands = {key: ([u for u, _, _ in bands], [(a, 1.0 / bw) for _, a, bw in bands])
                       for key, bands in cluster.collective_bands.items() if bands}
        # Results of pure functions of this model, keyed by the function's name and arguments
        # (``planner.costs.reshard_cost``, the planner builder's node timers and tables): a
        # search builds many problems on one mesh shape (every family and hint), which ask
        # the same questions of one model.
        self.memo: dict = {}

    # ------------------------------------------------------------------ links
    def _intra(self, kind: str) -> Link:
        """The intra-node link of ``kind``: a calibrated per-collective fit, else for a P2P
        the links to one peer (``Cluster.intra_peer``), else the whole ``intra`` link."""
        got = self.cluster.collective_links.get(kind)
        if got is not None:
            return got
        if kind == "p2p" and self.cluster.intra_peer is not None:
            return self.cluster.intra_peer
        return self.cluster.intra

    def _axis(self, axis: int):
        try:
            return self._axes[axis]
        except IndexError:
            raise IndexError(f"mesh axis {axis} out of range for mesh {self.mesh_shape}") from None

    def _alpha_beta(self, axis: int, kind: str) -> tuple[float, float]:
        key = (axis, kind)
        ab = self._eff.get(key)
        if ab is not None:
            return ab
        n, crosses, n_in, n_out = self._axis(axis)
        li = self._intra(kind)
        a_i, b_i = li.alpha_s, 1.0 / li.bw_bytes_per_s
        if not crosses or n == 1:
            ab = (a_i, b_i)
        else:
            lo = self.cluster.inter
            a_o, b_o = lo.alpha_s, 1.0 / lo.bw_bytes_per_s
            if kind == "p2p":
                ab = (max(a_o, a_i), max(b_o, b_i))
            else:
                alpha = ((n_in - 1) * a_i + (n_out - 1) * a_o) / (n - 1)
                beta = n / (n - 1) * ((n_in - 1) / n_in * b_i + (n_out - 1) / (n_out * n_in) * b_o)
                ab = (max(alpha, a_i), max(beta, b_i))
        self._eff[key] = ab
        return ab

    def _ab(self, axis: int, kind: str, nbytes: float) -> tuple[float, float]:
        """alpha, beta for a message of ``nbytes``: the calibrated band if there is one, the
        one measured on groups of this axis's size where the profile has them."""
        if not self._bands or self._axes[axis][1]:
            return self._alpha_beta(axis, kind)
        bands = self._bands.get((kind, self._axes[axis][0])) or self._bands.get(kind)
        if bands is None:
            return self._alpha_beta(axis, kind)
        i = bisect_left(bands[0], nbytes)
        return bands[1][i if i < len(bands[1]) else -1]

    def axis_link(self, axis: int, kind: str = "all_gather") -> Link:
        """The effective ring link of mesh axis ``axis`` (see the module docstring for the
        hierarchical formula). ``kind`` selects a calibrated per-collective fit if any."""
        a, b = self._alpha_beta(axis, kind)
        return Link(a, 1.0 / b)

    def axis_signature(self, axis: int) -> tuple:
        """What every cost on ``axis`` depends on: axes with equal signatures (the two
        intra-node axes of a 2x2x2 mesh) cost alike, so callers may share memos."""
        return self._axis(axis)

    def axis_size(self, axis: int) -> int:
        return self._axis(axis)[0]

    def crosses_nodes(self, axis: int) -> bool:
        return self._axis(axis)[1]

    # ------------------------------------------------------------------ compute
    def compute(self, flops: float, bytes_moved: float, dtype="fp32", op: str = "") -> float:
        """Roofline seconds: max(flops / achievable FLOP/s, bytes / memory bandwidth), times
        the measured slowdown of ``op`` (an aten op name) where the device has one."""
        return roofline(self.device, flops, bytes_moved, dtype, op)

    def copy(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` into a buffer allocated for it (read and write every
        byte), at the measured slowdown of a clone where the device has one (``calibrate``:
        on a CPU a new buffer's pages fault in as the copy first touches them), and a buffer
        the allocator hands fresh memory each time (:meth:`fresh`) first touched."""
        return roofline(self.device, 0.0, 2.0 * nbytes, "fp32", COPY_OP) + self.fresh(nbytes)

    def fresh(self, nbytes: float) -> float:
        """Seconds a new tensor of ``nbytes`` costs beyond writing it
        (``compute.fresh_alloc_time``: 0 but on a device whose allocator maps blocks that
        size fresh each time)."""
        return fresh_alloc_time(self.device, nbytes)

    def gemm(self, flops: float, bytes_moved: float, dtype="fp32") -> float:
        """Seconds of one GEMM of ``flops`` FLOPs: :meth:`compute` at its size's efficiency
        (``cost_models.compute.gemm_time``)."""
        return gemm_time(self.device, flops, bytes_moved, dtype)

    def batched_gemm_extra(self, batch: int, weight_bytes: float) -> float:
        """Seconds a GEMM batched ``batch`` ways over one shared weight of ``weight_bytes``
        adds to :meth:`gemm` of the same FLOPs (``compute.batched_weight_time``)."""
        return batched_weight_time(self.device, batch, weight_bytes)

    # ------------------------------------------------------------------ collectives
    def _made(self, kind: str, nbytes: float, n: int) -> float:
        """A collective's output's first touch where the device's allocator maps a block that
        size fresh (:meth:`fresh`; ``compute.collective_output_bytes``): the functional
        collectives allocate it every call. A calibration profile's lines are fitted to its
        samples less that part (``calibrate``), so it is charged here once."""
        return self.fresh(collective_output_bytes(kind, nbytes, n))

    def all_gather(self, nbytes: float, axis: int) -> float:
        """Seconds to all-gather along ``axis`` into a full tensor of ``nbytes`` bytes."""
        n = self._axis(axis)[0]
        if n == 1:
            return 0.0
        a, b = self._ab(axis, "all_gather", nbytes)
        return (n - 1) * a + (n - 1) / n * nbytes * b + self._made("all_gather", nbytes, n)

    def reduce_scatter(self, nbytes: float, axis: int) -> float:
        """Seconds to reduce-scatter a full tensor of ``nbytes`` bytes along ``axis``."""
        n = self._axis(axis)[0]
        if n == 1:
            return 0.0
        a, b = self._ab(axis, "reduce_scatter", nbytes)
        return (n - 1) * a + (n - 1) / n * nbytes * b + self._made("reduce_scatter", nbytes, n)

    def all_reduce(self, nbytes: float, axis: int) -> float:
        """Seconds to all-reduce a tensor of ``nbytes`` bytes along ``axis``."""
        n = self._axis(axis)[0]
        if n == 1:
            return 0.0
        a, b = self._ab(axis, "all_reduce", nbytes)
        return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes * b + self._made("all_reduce", nbytes, n)

    def coalesced(self, kind: str, nbytes: float, axis: int, message_bytes: float) -> float:
        """Seconds of ``nbytes``' part of one collective of ``kind`` ("all_gather",
        "reduce_scatter", "all_reduce") that carries ``message_bytes`` in all: a runtime that
        coalesces small parameter collectives (data-parallel gradient buckets, a ZeRO layer's
        one gather) pays one latency per message, shared by its parts in proportion to their
        bytes. A part at least as large as the message is a message of its own."""
        fn = getattr(self, kind)
        if message_bytes <= nbytes:
            return fn(nbytes, axis)
        return fn(message_bytes, axis) * (nbytes / message_bytes)

    def all_to_all(self, nbytes: float, axis: int, received: float | None = None) -> float:
        """Seconds for an all-to-all along ``axis`` of a tensor whose full size is ``nbytes``
        (each rank holds nbytes/n and sends (n-1)/n of it). ``received``: the fraction of
        its piece the busiest rank receives where that is not (n-1)/n (a redistribution by
        slice overlap, ``placement.received_fraction``): the volume scales with it."""
        n, crosses, n_in, _ = self._axis(axis)
        if n == 1:
            return 0.0
        shard = nbytes / n if received is None else nbytes / n * received * n / (n - 1)
        made = self._made("all_to_all", nbytes, n)  # (its output: the rank's new piece)
        if not crosses:
            a, b = self._ab(axis, "all_to_all", nbytes)
            return (n - 1) * a + (n - 1) / n * shard * b + made
        li = self._intra("all_to_all")
        t_intra = (n - 1) * li.alpha_s + (n - 1) / n * shard / li.bw_bytes_per_s
        lo = self.cluster.inter
        t = ((n_in - 1) * li.alpha_s + (n - n_in) * lo.alpha_s
             + shard * ((n_in - 1) / n / li.bw_bytes_per_s + (n - n_in) / n / lo.bw_bytes_per_s))
        return max(t, t_intra) + made

    def p2p(self, nbytes: float, axis: int) -> float:
        """Seconds for every rank to send ``nbytes`` to its ring neighbour along ``axis``."""
        if self._axis(axis)[0] == 1:
            return 0.0
        a, b = self._ab(axis, "p2p", nbytes)
        return a + nbytes * b

    def own_peer_links(self, axis: int) -> bool:
        """Whether a device reaches each of its peers along ``axis`` over links of that pair's
        own (``Cluster.intra_peer``, an axis inside one node, no calibrated P2P fit: the
        fully connected NVLink board), so that transfers posted at once to different peers
        run side by side; otherwise (a switch, a NIC, loopback TCP) they share the device's
        port."""
        return (self.cluster.intra_peer is not None and not self._axis(axis)[1]
                and "p2p" not in self.cluster.collective_links and not self._bands.get("p2p"))

    def p2p_to_peers(self, sizes, axis: int) -> float:
        """Seconds for every rank to send the blocks of ``sizes`` (bytes), posted at once to
        different peers along ``axis`` (a P(2^k x 2^k) step's activation and weight blocks):
        the longest transfer where each peer has links of its own (:meth:`own_peer_links`),
        else one message of their bytes together through the shared port (on the
        development VM, two 2 MiB blocks to two peers took 4.06 ms against 2.46 ms for one
        and 4.50 ms for one 4 MiB block: the forty-eighth session's scratch measurement)."""
        sizes = [float(x) for x in sizes if x > 0]
        if not sizes:
            return 0.0
        if self.own_peer_links(axis):
            return max(self.p2p(x, axis) for x in sizes)
        return self.p2p(sum(sizes), axis)

    def overlapped(self, comm_s, window_s):
        """Seconds a collective that may run beside ``window_s`` of compute adds to the step
        (``overlap.exposed`` with this model's slowdown; numpy arrays broadcast)."""
        return exposed(comm_s, window_s, self.overlap_slowdown)

    def blocking(self, collective_s: float, after_ring: bool = False, since_meeting_s: float | None = None) -> float:
        """Seconds a collective of ``collective_s`` adds where every rank waits on it at once
        (an activation's reshard): its own time and the ranks' skew in reaching it
        (``Cluster.collective_sync_s``), or where it runs right after a ring op's backward
        (``after_ring``: the ranks met at the ring's last exchange, one GEMM step before;
        ``Cluster.ring_sync_s``); 0 for no collective.

        ``since_meeting_s``: where the ranks of its group met a known compute before (a norm
        kept in a grid layout all-gathers its statistics, then normalises: a reshard of its
        output follows that compute), the skew that compute leaves, by the square-root law
        through the profile's figure (``collective_sync_s * sqrt(since / the compute it was
        measured after)``, at most ``collective_sync_s``): the ranks' skew grows with the
        compute since they met, as the skew section of benchmarks/RESULTS.md measures it
        (``benchmarks/skew_check.py``: on the development VM, after a grid LayerNorm under a
        millisecond, after one GEMM block about 5 ms, after four about 12). Without the
        profile's compute, the full figure."""
        if collective_s <= 0:
            return 0.0
        if after_ring:
            return collective_s + self.ring_sync_s
        sync = self.collective_sync_s
        if since_meeting_s is not None and self.collective_sync_compute_s:
            sync *= min(1.0, math.sqrt(max(0.0, since_meeting_s) / self.collective_sync_compute_s))
        return collective_s + sync

    def ring_step(self, compute_s: float, transfer_s: float, slowdown: float | None = None) -> float:
        """One double-buffered ring step: the longer of its GEMM and its transfer, the
        shorter one running beside it at the ring's overlap slowdown (``overlap``: compute
        beside communication runs slower; on shared CPU cores the two barely overlap at all;
        ``slowdown``, default ``Cluster.ring_overlap_slowdown``), and the step's own
        launch/synchronisation overhead (``Cluster.ring_step_overhead_s``). ``transfer_s``
        includes the P2P's latency."""
        s = self.ring_overlap_slowdown if slowdown is None else slowdown
        if compute_s > transfer_s:
            return compute_s + s * transfer_s + self.ring_step_overhead_s
        return transfer_s + s * compute_s + self.ring_step_overhead_s

    def ring(self, compute_s: float, transfers_s, slowdown: float | None = None) -> float:
        """A ring schedule as the runtime runs it (``runtime.ops.ring``): one step per entry
        of ``transfers_s``, each running ``compute_s`` of GEMMs beside the transfer it
        posted, 0 for a step that moves nothing (a ring of n blocks moves n - 1 of them:
        the AG ring's last step and the RS ring's first compute on what is there).
        ``slowdown``: as :meth:`ring_step`'s (a P(2^k x 2^k) op's: ``grid_overlap_slowdown``)."""
        return sum(self.ring_step(compute_s, t, slowdown) for t in transfers_s)

    # ------------------------------------------------------------------ memory
    @property
    def device_memory_bytes(self) -> float:
        """Memory capacity of one device, bytes."""
        return self.cluster.device.mem_bytes

    def __repr__(self) -> str:
        return f"CostModel({self.cluster.name!r}, mesh_shape={self.mesh_shape})"
