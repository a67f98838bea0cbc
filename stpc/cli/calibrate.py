"""Measure this machine and write a calibration profile (``python -m stpc calibrate``).

What is measured, with ``world_size`` ranks running at once (the SPMD situation the
planner models):

* matmul throughput for GEMMs of several sizes and dtypes and memory bandwidth from a
  large copy, each sustained over a window in which every rank computes at once (median
  over ranks): on a machine whose cores the ranks share, what one rank gets of them during
  a step. Per dtype the line ``seconds = ramp + flops / rate`` through the sizes gives the
  large-GEMM rate and its ramp, the device's GEMM efficiency curve
  (``DeviceSpec.gemm_ramps``, ``cost_models.profile.fit_gemm_curve``);
* all-gather, reduce-scatter, all-reduce, all-to-all and ring P2P (every rank sends to
  its right neighbour) over a range of message sizes (``DEFAULT_SIZES``), on gloo over
  127.0.0.1 on CPU or NCCL on GPUs, issued as the runtime issues them (functional
  collectives, a fresh output each call). A sample's time is the slowest rank's, the
  median of several timed windows. The collectives are timed again on every smaller
  group size a mesh axis can have (``sub_group_sizes``: 2 of 4 ranks), all groups at
  once: a pair's gather is not the world's ring formula at n=2 (on the development VM's
  loopback, 1.1x it at 4-16 MiB and 1.9x at 64 MiB);
* on CPU ranks, forward + backward of each op the built-in models use that is not a GEMM
  (layer norm, gelu, attention, the loss, ...), every rank at once, against the roofline
  time the planner charges it (``stpc.cli.calibrate_ops``): the device's ``op_slowdown``;
  and a copy into a new buffer (a clone, ``COPY_BYTES``) against the warm copy's rate:
  ``op_slowdown["aten.clone.default"]``, what the runtime's copies cost (``CostModel.copy``);
  and one step of torch's AdamW over ``OPTIMIZER_NUMEL`` elements against the roofline of
  the bytes it moves (``cost_models.compute.optimizer_step_bytes``), foreach and fused:
  ``op_slowdown["optimizer.adamw"]`` and ``op_slowdown["optimizer.adamw[fused]"]``;
* a ring step's GEMM when its block does not fold to rows (``batched_gemm``, the device's
  ``batch_reread_bw``): a block of ``BATCHED_BLOCK`` (batch x rows of a [batch, seq, d]
  activation split on seq) times one weight, written into a strided slice of a larger
  output as ``runtime.ops.kernels.ring_step_matmul`` runs it (a GEMM batched over the
  shared weight), against the same rows as one 2-D GEMM, every rank at once, in rounds;
  the difference is the weight read again per batch element past the first. On the
  development VM (MKL, one thread a rank) it fell with the rows per element: 1.6 ms at 128
  rows, 1.0 ms at 256 and nothing at 512 for a 3 MiB weight, so the probe uses the rows the
  fidelity bench's ring steps have (its GPT at batch 4, seq 512, on 4 ranks). It fell with
  the weight's size too, where the cache holds the weight between elements: a 1 MiB
  weight was read again at 16-26 GB/s, a 4 MiB one at 6-8 GB/s (1 MiB of L2 a core), so the
  probe runs a second, smaller weight (``BATCHED_SMALL``, the fidelity GPT's q/k/v step) and
  the two fix the bandwidth and how much of a weight the cache serves
  (``batch_reread_cached_bytes``, :func:`reread_fit`);
* on CPU ranks, a fresh allocation (``fresh_alloc``, the device's ``fresh_alloc_bytes`` and
  ``fresh_page_bw``): a clone of ``FRESH_BYTES``, above glibc's mmap cap (every block from
  ``GLIBC_MMAP_THRESHOLD_MAX``, 32 MiB, is mapped fresh at each allocation and unmapped when
  freed), against a copy into a warm buffer of its size, every rank at once, in rounds: the
  difference is the pages' first touches, which the planner charges every tensor that size
  the program makes (``CostModel.fresh``);
* how compute and communication overlap (``overlap`` in the profile), three ways, each
  as the runtime meets it:

  - a ring step (``ring_slowdown``, ``ring_step_overhead_s``): one step's GEMM alone, its
    P2P alone, and stpc's own AG-ring (``runtime.ops.ring_allgather_matmul``, the
    transfer posted before each step's GEMM and waited after it), once with blocks whose
    GEMM is long and once with tiny blocks. The tiny ring gives the per-step overhead
    (its time beyond its GEMMs and P2Ps), the long one the compute slowdown beside a
    transfer: step = max(gemm, p2p) + slowdown * min(gemm, p2p) + overhead, for each of
    the ring's steps but the last, which moves nothing (``CostModel.ring``, as the planner
    costs a ring: :func:`fit_overlap`). Every rank waits on every step, so the figure also
    holds the ranks' skew at each step;
  - a P(2^k x 2^k) op's steps (``grid_slowdown``, where the ranks form a grid: 4, 16, ...):
    stpc's own ``primepar_linear`` forward + backward on blocks whose step GEMM is the long
    ring's, against its 3q step GEMMs alone and its transfers alone, posted step by step as
    the planner charges them (:func:`grid_transfer_steps`): slowdown = (op - GEMMs - 3q
    overheads) / transfers (:func:`fit_grid`). On the development VM the two figures
    differ (2.41 and 1.42 in the s61 profile; likely, not tested apart: its blocks go to two
    neighbours at once and its backward hides two transfers behind its last GEMMs, where
    each AG-ring step waits on the one before around the ring);
  - an asynchronous collective beside compute (``slowdown``: a data-parallel gradient
    bucket, a ZeRO gather): an all-reduce of ``ASYNC_BYTES`` issued, a block of
    ``ASYNC_GEMMS`` GEMMs run, the all-reduce waited; against the two alone;
  - a blocking collective after compute (``collective_sync_s``, an activation's
    reshard): a block of ``SYNC_GEMMS`` GEMMs then an all-reduce of ``SYNC_BYTES``,
    against the collective alone and the block alone as the typical rank (the median over
    ranks) runs it: what the ranks' skew in reaching the collective adds to the typical
    rank's compute, the compute the planner charges (on a CPU shared by more ranks than
    cores, the scheduler's time slices; on GPUs, launch jitter). The noisiest figure
    here: ``SYNC_WINDOWS`` rounds. The skew depends on the compute since the ranks last
    met, which this one block does not follow (``benchmarks/skew_check.py`` measures it
    after several);
  - the same collective right after a ring (``ring_sync_s``): an AG ring of the long blocks
    then the all-reduce, against the two alone (the ring as the typical rank ran it): where
    the ranks met at the ring's last exchange one GEMM step before, as a transfer right
    after a P(2^k x 2^k) op's backward does (``benchmarks/skew_check.py`` sets a P(2x2)
    op beside its GEMMs as a plain block).

  Each probe's parts are timed in rounds, one window of each part per round, and every
  term is the median of its per-round values (``_rounds``): a term is a difference of
  parts, and parts timed one after the other carried the machine's drift between them
  into it. ``--rounds N`` sets every such probe's number of rounds (each has its own
  default): fewer is quicker and noisier.

  On a CPU whose cores the ranks share, gloo's transfers take the same cores the GEMM
  needs, and the slowdowns come out near 1 (no overlap); on GPUs they are small.

alpha and beta are then fitted by least squares (``cost_models.profile``): one fit per
collective kind plus a joint fit, and the profile is written as JSON. Load it with
``stpc.cost_models.get_cluster("profile.json")``.

Ranks are started by ``stpc.runtime.launch.spawn`` (the one launcher) with a hard
deadline: on timeout or any rank's failure all children are killed and an error says
which and why; nothing hangs.

``python -m stpc calibrate [--json profile.json] [--ranks 4] [--sizes 64K,1M,16M]``: the
profile goes to ``--json`` (``--out``, its old name, still works); ``--quiet`` prints only
the path written. ``--amend PROFILE [--probe NAME ...]`` measures only the probes named
(``batched_gemm``, ``fresh_alloc``, ``collectives``: the default grid's message sizes,
where the profile lacks one; ``overlap``: the ring, asynchronous and blocking probes,
fitted as the planner now costs a ring; ``ops``: the op probes' slowdowns, a probe added
since included; ``optimizer``: the AdamW steps, foreach and fused; default: all, on a
profile of NCCL ranks all but ``fresh_alloc``, ``ops`` and ``optimizer``) into ``PROFILE``,
written before they had their present form, on as many ranks as it was measured with,
writes them in and notes each amendment (probe, date, host, torch; the collectives' sizes)
under the profile's ``amended``.
Exit codes: 0 written, 1 the measurement failed, 2 a usage error.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

from stpc.cli._common import TORCH_DTYPES, Failure, Parser, add_flags, verb
from stpc.cli._progress import Status
from stpc.cli.calibrate_ops import PROBES, fit_op_slowdown, probe_facts, probe_step
from stpc.cost_models import DeviceSpec, get_device
from stpc.cost_models.cluster import RING_STEP_OVERHEAD_S
from stpc.cost_models.compute import (COPY_OP, FUSED_OPTIMIZER_OP, OPTIMIZER_OP, collective_output_bytes,
                                      fresh_alloc_time, optimizer_step_bytes)
from stpc.cost_models.profile import (KINDS, device_spec, fit_alpha_beta, fit_bands, fit_gemm_curve, read_profile,
                                      save_profile)
from stpc.runtime.launch import SpawnTimeout, spawn
from stpc.runtime.ops import primepar_linear, ring_allgather_matmul
from stpc.runtime.ops.ring import primepar_peers
from stpc.runtime.ops.kernels import ring_step_matmul
from stpc.runtime.reshard import _c10d

# The message sizes: powers of 4 from 64 KiB, and two more between 16 and 64 MiB, where a
# layer's gathers and gradient buckets fall and the transport's cost per byte still bends;
# one sample at 16 MiB had set that whole band (the development VM's: 16-28 MiB all-gathers
# predicted 33-54% high, 40-64 MiB within 6%). Neither at 32 MiB, glibc's mmap cap
# (GLIBC_MMAP_THRESHOLD_MAX), where the output's first touch jumps (``transfer_samples``).
DEFAULT_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 24 << 20, 40 << 20, 64 << 20]
COLLECTIVE_ITERS = 5  # timed windows per collective and size (``_time_ops``)
MATMUL_SHAPES = [(128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024)]
MATMUL_DTYPES = ("fp32", "bf16", "fp16")


# ----------------------------------------------------------------------------- workers


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _repeats(fn, dev, min_window_s: float) -> int:
    """Warm ``fn`` up and return how many back-to-back calls fill ``min_window_s`` (the
    same on every rank: the slowest rank's single-call time decides)."""
    for _ in range(3):  # warm-up: connection setup, allocator, first-touch pages
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    return int(min(50, max(1, -(-min_window_s // float(one.item())))))


def _window(fn, reps: int, dev) -> float:
    """Seconds per call over one window of ``reps`` back-to-back calls on this rank."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / reps


def _time_ops(fns: list, iters: int, dev, min_window_s: float = 0.03) -> list[float]:
    """Seconds per call of each closure in ``fns``.

    Each closure runs in ``iters`` windows of back-to-back calls lasting about
    ``min_window_s`` (barrier skew and scheduling jitter, milliseconds when ranks
    outnumber cores, are amortised). Windows go round-robin over all closures so a
    change in the machine's load spreads over every size instead of bending the curve.
    A window lasts as long as its slowest rank; the result is the median window, what a
    training step meets: where ranks outnumber cores the fastest window is the one the
    scheduler happened to favour (at 4 to 24 MiB, 10-30% below the median on the
    development VM), and the planner predicts the median of measured steps."""
    reps = [_repeats(fn, dev, min_window_s) for fn in fns]
    times = [[_window(fn, r, dev) for fn, r in zip(fns, reps)] for _ in range(iters)]
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return t.median(dim=0).values.tolist()


def _collective_fn(kind: str, nbytes: int, rank: int, world: int, dev, group=None):
    """A closure running one ``kind`` whose full tensor is ``nbytes`` (per-rank message for p2p)
    over ``group`` (None: every rank). Collectives run as the runtime issues them: torch's
    functional collectives (``stpc.runtime.reshard``), which allocate their output on every
    call, and waited at once. (A preallocated output times a warm buffer: over loopback
    gloo a fresh one cost 1.35-1.5x more at 24-64 MiB on the development VM, its pages
    faulting in.)"""
    group = group or dist.group.WORLD
    n, name = dist.get_world_size(group), group.group_name
    elems = max(n, nbytes // 4 // n * n)  # fp32, divisible by the group
    if kind == "all_gather":
        inp = torch.ones(elems // n, device=dev)
        return lambda: _c10d.wait_tensor(_c10d.all_gather_into_tensor(inp, n, name))
    if kind == "reduce_scatter":
        inp = torch.ones(elems, device=dev)
        return lambda: _c10d.wait_tensor(_c10d.reduce_scatter_tensor(inp, "sum", n, name))
    if kind == "all_reduce":
        buf = torch.ones(elems, device=dev)
        return lambda: _c10d.wait_tensor(_c10d.all_reduce(buf, "sum", name))
    if kind == "all_to_all":
        per = max(n, nbytes // 4 // n // n * n)  # this rank's part, n equal pieces
        inp, split = torch.ones(per, device=dev), [per // n] * n
        return lambda: _c10d.wait_tensor(_c10d.all_to_all_single(inp, split, split, name))
    if kind == "p2p":
        n = max(1, nbytes // 4)
        send, recv = torch.ones(n, device=dev), torch.empty(n, device=dev)
        right, left = (rank + 1) % world, (rank - 1) % world

        def ring_shift():
            ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
        return ring_shift
    raise ValueError(f"unknown collective {kind!r}")


def sub_group_sizes(world: int) -> list[int]:
    """The group sizes below the world a mesh axis of ``world`` ranks can have (its proper
    divisors from 2): ``calibrate`` times each kind on them too, every group of consecutive
    ranks at once (the groups of a mesh's innermost axis)."""
    return [d for d in range(2, world) if world % d == 0]


def _sustained(fn, dev, window_s: float) -> float:
    """Seconds per call of ``fn`` kept busy for ``window_s`` right after a barrier: every
    rank runs its loop over the same window, so the rate is what one rank gets while all
    of them compute (on a CPU shared by the ranks, its share of the cores), not what a
    lone call gets in a moment another rank left its core free."""
    fn()
    _sync(dev)
    dist.barrier()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0 or dev.type != "cuda":
            _sync(dev)
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                return elapsed / calls


def _matmul_rates(dev, window_s: float = 0.4) -> list[dict]:
    out = []
    for dt in MATMUL_DTYPES:
        shapes = MATMUL_SHAPES if dt != "fp16" else MATMUL_SHAPES[:3]  # CPU fp16 GEMM is slow
        for m, n, k in shapes:
            a = torch.randn(m, n, device=dev, dtype=TORCH_DTYPES[dt])
            b = torch.randn(n, k, device=dev, dtype=TORCH_DTYPES[dt])
            sec = _sustained(lambda: torch.mm(a, b), dev, window_s)
            out.append({"m": m, "n": n, "k": k, "dtype": dt, "seconds": sec, "flops_per_s": 2.0 * m * n * k / sec})
    return out


def _mem_bw(dev, nbytes: int = 64 << 20, window_s: float = 0.4) -> float:
    x = torch.ones(nbytes // 4, device=dev)
    y = torch.empty_like(x)
    return 2.0 * nbytes / _sustained(lambda: y.copy_(x), dev, window_s)  # a copy reads and writes every byte


# The copy the runtime makes of a ZeRO-3 layer's weights and gradients (``CostModel.copy``):
# into a buffer allocated for it, each time. Its size: one such layer of the fidelity bench.
COPY_BYTES = 24 << 20


def _fresh_copy(dev, nbytes: int = COPY_BYTES, window_s: float = 0.3) -> float:
    """Seconds per copy of ``nbytes`` into a newly allocated buffer (a clone), every rank at
    once: beyond :func:`_mem_bw`'s copy into a warm buffer, what a fresh allocation costs
    (on a CPU, the kernel's first-touch page faults)."""
    x = torch.ones(nbytes // 4, device=dev)
    return _sustained(lambda: x.clone(), dev, window_s)


# The parameters the optimizer-step probe updates: a whole layer of the fidelity bench's GPT
# (d_model 1024, ffn 4096: 12.6M elements) on every rank, a state as large as a real step's
# layer streams. The probe stepped a quarter layer until the fifty-ninth session, when one
# scratch run suggested the quarter's state ran from the cache; ``benchmarks/
# optimizer_size_check.py`` found the rate the same from 3.15M to 50.4M elements a rank on
# the development VM (RESULTS.md, that session's paragraph), but only a state past the
# last-level cache is sure to be timed as a training step runs it.
OPTIMIZER_SHAPES = ((1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024), (1024,), (1024,))
OPTIMIZER_NUMEL = sum(math.prod(s) for s in OPTIMIZER_SHAPES)
OPTIMIZER_WINDOW_S = 1.0  # a step of 12.6M elements takes tens of ms on a CPU rank: several in the window


# The AdamW implementations the optimizer probe times, by the op their slowdown goes under.
OPTIMIZER_PROBES = {OPTIMIZER_OP: "foreach", FUSED_OPTIMIZER_OP: "fused"}


def _optimizer_step(dev, impl: str = "foreach", window_s: float = OPTIMIZER_WINDOW_S) -> float:
    """Seconds per step of torch's AdamW (``impl``: ``"foreach"`` or ``"fused"``, as the benches
    run it) over ``OPTIMIZER_SHAPES``, every rank at once; its state made by a first step."""
    params = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in OPTIMIZER_SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
    opt.step()
    return _sustained(opt.step, dev, window_s)


def _optimizer_steps(dev, rounds: int | None = None) -> dict[str, float]:
    """:func:`_optimizer_step` of each of :data:`OPTIMIZER_PROBES`, by op (``rounds``: unused, a
    window)."""
    return {op: _optimizer_step(dev, impl) for op, impl in OPTIMIZER_PROBES.items()}


def fit_optimizer(measured: dict[str, float], mem_bw: float) -> dict[str, dict]:
    """Each optimizer probe's step (op -> seconds) against the roofline of the bytes its
    implementation moves at ``mem_bw``: op -> measured, roofline and slowdown."""
    out = {}
    for op, secs in measured.items():
        roof = OPTIMIZER_NUMEL * optimizer_step_bytes("fp32-adam", OPTIMIZER_PROBES[op]) / mem_bw
        out[op] = {"measured_s": secs, "roofline_s": roof, "slowdown": secs / roof}
    return out


# The AG-ring blocks the overlap is measured with: (rows per rank, n, k) of a step's GEMM.
# Long: a gpt-50m linear's step on 4 ranks (2048 tokens / 4 x 1024 -> 1024). Tiny: latency only.
OVERLAP_LONG = (512, 1024, 1024)
OVERLAP_TINY = (8, 64, 64)


def _ring_times(dev, world: int, rows: int, n: int, k: int, window_s: float,
                rounds: int) -> list[tuple[float, float, float]]:
    """(GEMM, P2P, ring step) seconds of one AG-ring step, every rank at once (the step: the
    ring's whole time over its ``world`` steps), in ``rounds`` :func:`_rounds`."""
    x = torch.randn(rows, n, device=dev)
    w = torch.randn(n, k, device=dev)
    # (a P2P or a ring needs every rank in every call: the same number of calls on each rank,
    # not a window each rank ends by its own clock)
    p2p = _collective_fn("p2p", x.numel() * x.element_size(), dist.get_rank(), world, dev)
    times = _rounds([lambda: torch.mm(x, w), p2p, lambda: ring_allgather_matmul(x, w, 0, dist.group.WORLD)],
                    dev, window_s, rounds)
    return [(g, c, ring / world) for g, c, ring in times]


def grid_transfer_steps(q: int) -> list[tuple[str, ...]]:
    """The blocks each transfer step of a P(q x q) linear's forward + backward moves (x: an
    input block, w: a weight block, o: an output-gradient block), as the planner charges
    them (``planner.costs.NodeTimer``'s ``p2x2``): q - 1 steps each of the forward (x, w) and
    the backward (o, w); the gradient phase's first step (x, o) with the dI shift's x, its
    middle ones (x, o), its last the dW accumulator's w."""
    return [("x", "w")] * (q - 1) + [("o", "w")] * (q - 1) + [("x", "o", "x")] + [("x", "o")] * (q - 2) + [("w",)]


def grid_side(world: int) -> int | None:
    """q of the P(q x q) grid, q = 2^k >= 2, that ``world`` ranks form; None if they form none."""
    q = math.isqrt(world)
    return q if q * q == world and q >= 2 and q & (q - 1) == 0 else None


def _grid_times(dev, world: int, rows: int, n: int, k: int, window_s: float,
                rounds: int) -> list[tuple[float, float, float]] | None:
    """(GEMMs, transfers, op) seconds of stpc's P(q x q) linear (``runtime.ops.primepar_linear``),
    forward + backward on blocks x [rows, n], w [n, k], every rank at once: its 3q step GEMMs
    alone, its transfers alone (:func:`grid_transfer_steps`, each step's blocks posted together
    to the op's grid neighbours and waited), and the op, in ``rounds`` :func:`_rounds`; None
    where ``world`` ranks form no such grid."""
    q = grid_side(world)
    if q is None:
        return None
    x = torch.randn(rows, n, device=dev, requires_grad=True)
    w = torch.randn(n, k, device=dev, requires_grad=True)
    do = torch.randn(rows, k, device=dev)
    blocks = {"x": x.detach(), "w": w.detach(), "o": do}
    out, di, dw = (torch.empty(rows, k, device=dev), torch.empty(rows, n, device=dev),
                   torch.empty(n, k, device=dev))
    (i_to, i_from, _), (w_to, w_from, _) = primepar_peers(dist.get_rank(), q.bit_length() - 1)

    def op():
        primepar_linear(x, w, dist.group.WORLD, q.bit_length() - 1).backward(do)
        x.grad = w.grad = None

    def gemms():
        xs, ws = blocks["x"], blocks["w"]
        for t in range(q):
            ring_step_matmul(xs, ws, out, accumulate=t > 0)
        for t in range(q):
            ring_step_matmul(do, ws.t(), di, accumulate=t > 0)
        for t in range(q):
            ring_step_matmul(xs.t(), do, dw, accumulate=t > 0)

    recv = {(j, name): torch.empty_like(b) for j in range(3) for name, b in blocks.items()}

    def transfers():
        for step in grid_transfer_steps(q):  # (alternate neighbours, as the op sends its two streams)
            ops = []
            for j, name in enumerate(step):
                to, frm = (i_to, i_from) if j % 2 == 0 else (w_to, w_from)
                ops += [dist.P2POp(dist.isend, blocks[name], peer=to, tag=j),
                        dist.P2POp(dist.irecv, recv[j, name], peer=frm, tag=j)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    return _rounds([gemms, transfers, op], dev, window_s, rounds)


# Rounds of each overlap probe. At 5, two calibrations of the development VM minutes apart
# (the fiftieth session) gave ring slowdowns of 1.56 and 2.40, the asynchronous one 1.34 and
# 1.04, the blocking sync 13.2 and 8.5 ms (a scratch run of stpc::primepar_linear's fwd + bwd
# on the fidelity GPT's blocks paid 1.8-2.4x its modelled transfers over its GEMMs alone; the
# grid probe, _grid_times, measures that op's own figure now): a
# median of five differences of parts on a shared 2-core machine is still one unlucky round
# from another. At 15, four calibrations that session gave 1.87-2.43, 0.97-1.15, 7.4-12.3 ms.
OVERLAP_ROUNDS = 15

# The batched-block probe: (batch, rows per element, n, k) of one ring step's GEMM whose
# block does not fold to rows (module docstring).
BATCHED_BLOCK = (4, 128, 1024, 1024)
# ... and at a weight a quarter the size (1 MiB), to see how much of a weight the cache serves
BATCHED_SMALL = (4, 128, 1024, 256)
# Its rounds: the difference it measures is a tenth of either part (three calibrations of
# the development VM at 5 rounds gave 5.1, 6.2 and 10.4 GB/s)
BATCHED_ROUNDS = 15


def _block_pair(shape: tuple[int, int, int, int], dev) -> list:
    """(batched, 2-D) closures of one ring step's GEMM on a block of ``shape``: batched, the
    block ([batch, rows, n], a slice of seq) into its strided slice of a [batch, seq, k]
    output, as ``ring_step_matmul`` runs it; 2-D, the same rows as one [batch * rows, n]
    block into a matrix of its own."""
    batch, rows, n, k = shape
    w = torch.randn(n, k, device=dev)
    block = torch.randn(batch, rows, n, device=dev)
    out = torch.empty(batch, 4 * rows, k, device=dev)
    flat = torch.randn(batch * rows, n, device=dev)
    out2 = torch.empty(batch * rows, k, device=dev)
    return [lambda: ring_step_matmul(block, w, out[:, rows:2 * rows], accumulate=False),
            lambda: ring_step_matmul(flat, w, out2, accumulate=False)]


def _batched_block(dev, rounds: int | None = None, window_s: float = 0.2) -> list[tuple[float, float, float, float]]:
    """(batched, 2-D) seconds of ``BATCHED_BLOCK``'s step, then ``BATCHED_SMALL``'s, every rank
    at once, in ``rounds`` (default ``BATCHED_ROUNDS``) :func:`_rounds` (:func:`_block_pair`)."""
    return _rounds(_block_pair(BATCHED_BLOCK, dev) + _block_pair(BATCHED_SMALL, dev), dev, window_s,
                   rounds or BATCHED_ROUNDS)


def reread_fit(batch: int, big: tuple[float, float], small: tuple[float, float]) -> tuple[float | None, float]:
    """(``batch_reread_bw``, ``batch_reread_cached_bytes``) from the extra seconds of two
    batched blocks, ``(weight bytes, extra s)`` each: the extra is ``(batch - 1) * max(0,
    weight - cached) / bw`` (``cost_models.compute.batched_weight_time``), through both
    points. A small weight that cost nothing extra is all cached (the bandwidth from the
    rest of the big one); one that cost as much a byte as the big one or more, none of it
    (the big one alone gives the bandwidth); no extra on the big one, no cost at all."""
    (w_big, e_big), (w_small, e_small) = big, small
    if e_big <= 0:
        return None, 0.0
    if e_small <= 0:
        return (batch - 1) * (w_big - w_small) / e_big, w_small
    if e_small * w_big >= e_big * w_small:
        return (batch - 1) * w_big / e_big, 0.0
    bw = (batch - 1) * (w_big - w_small) / (e_big - e_small)
    return bw, w_small - e_small * bw / (batch - 1)


def _block_entry(shape: tuple[int, int, int, int], rounds: list[tuple[float, float]]) -> dict:
    batched, rows_ = [b for b, _ in rounds], [m for _, m in rounds]
    return {"shape": list(shape), "batched_s": statistics.median(batched), "rows_s": statistics.median(rows_),
            "extra_s": statistics.median(b - m for b, m in rounds), "weight_bytes": 4.0 * shape[2] * shape[3]}


def fit_batched(per_rank: list[list[tuple[float, float, float, float]]]) -> dict:
    """The profile's ``batched_gemm`` from every rank's :func:`_batched_block` rounds: per
    round each part the slowest rank's; each block's extra the median over rounds of its
    two parts' difference (its weight's bytes read again ``batch - 1`` times); from the two
    extras, ``batch_reread_bw`` (None where the big block measured no slower) and
    ``batch_reread_cached_bytes`` (:func:`reread_fit`). The big block's entry at the top
    level, the small one's under ``small``."""
    rounds = slowest_rounds(per_rank)
    big = _block_entry(BATCHED_BLOCK, [r[:2] for r in rounds])
    small = _block_entry(BATCHED_SMALL, [r[2:] for r in rounds])
    bw, cached = reread_fit(BATCHED_BLOCK[0], (big["weight_bytes"], big["extra_s"]),
                            (small["weight_bytes"], small["extra_s"]))
    return {**big, "rounds": len(rounds), "small": small, "batch_reread_bw": bw, "batch_reread_cached_bytes": cached}


# The fresh-allocation probe (``DeviceSpec.fresh_alloc_bytes``, ``fresh_page_bw``): a tensor
# above glibc's mmap cap (``GLIBC_MMAP_THRESHOLD_MAX``), which malloc maps fresh at every
# allocation and unmaps when it is freed. On the development VM (4 ranks at once) a clone of
# 33 MiB took 29 ms where one of 31 MiB took 2.6 ms and a copy into a warm 33 MiB buffer
# 2.6 ms: the pages' first touches, not the bytes. (The fidelity bench's fsdp-tp plan once
# gathered its logits' rows, 32 MiB, at every step: 53506 page faults a step per rank.)
FRESH_BYTES = 48 << 20
FRESH_ROUNDS = 9
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (malloc/malloc.c: 4 * 1024 * 1024 *
# sizeof(long)): the dynamic mmap threshold, raised to each freed mapped block's size,
# stops there, so every block from this size on is mapped fresh.
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20


def fresh_alloc_threshold() -> int | None:
    """The size from which this process's allocator maps every CPU block fresh: glibc's
    ``MALLOC_MMAP_THRESHOLD_`` where set (a fixed threshold: the dynamic one is off), else
    its cap :data:`GLIBC_MMAP_THRESHOLD_MAX`; None off glibc (not measured there)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    fixed = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    return int(fixed) if fixed else GLIBC_MMAP_THRESHOLD_MAX


def _fresh_alloc(dev, rounds: int | None = None, window_s: float = 0.2) -> list[tuple[float, float]]:
    """(clone, copy into a warm buffer) seconds of ``FRESH_BYTES``, every rank at once, in
    ``rounds`` (default ``FRESH_ROUNDS``) :func:`_rounds`."""
    x = torch.ones(FRESH_BYTES // 4, device=dev)
    warm = torch.empty_like(x)
    return _rounds([lambda: x.clone(), lambda: warm.copy_(x)], dev, window_s, rounds or FRESH_ROUNDS)


def fit_fresh(per_rank: list[list[tuple[float, float]]], threshold: int | None) -> dict:
    """The profile's ``fresh_alloc`` from every rank's :func:`_fresh_alloc` rounds: per round
    each part the slowest rank's; the extra, the median over rounds of the clone less the
    warm copy; ``fresh_page_bw`` the probe's bytes over it (None where the clone cost no
    more, or the allocator has no such threshold: nothing to charge)."""
    rounds = slowest_rounds(per_rank)
    extra = statistics.median(c - w for c, w in rounds)
    bw = FRESH_BYTES / extra if extra > 0 and threshold is not None and FRESH_BYTES >= threshold else None
    return {"bytes": FRESH_BYTES, "rounds": len(rounds), "clone_s": statistics.median(c for c, _ in rounds),
            "warm_copy_s": statistics.median(w for _, w in rounds), "extra_s": extra,
            "fresh_alloc_bytes": threshold if bw else None, "fresh_page_bw": bw}


def fresh_line(f: dict) -> str:
    """One line of the fresh-allocation probe's profile entry (:func:`fit_fresh`)."""
    head = (f"fresh allocation: {f['bytes'] / 2**20:.0f} MiB cloned in {f['clone_s'] * 1e3:.2f} ms against "
            f"{f['warm_copy_s'] * 1e3:.2f} ms copied into a warm buffer")
    if not f["fresh_page_bw"]:
        return head + ": no extra cost"
    return (head + f": blocks from {f['fresh_alloc_bytes'] / 2**20:.0f} MiB first touched at "
            f"{f['fresh_page_bw'] / 1e9:.2f} GB/s")


def slowest_rounds(per_rank: list[list[tuple[float, ...]]]) -> list[tuple[float, ...]]:
    """Every rank's :func:`_rounds` as one: per round, each part the slowest rank's (every
    rank joined each call, so a part lasted as long as its slowest rank), over the rounds
    every rank has."""
    return [tuple(max(parts) for parts in zip(*(r[i] for r in per_rank)))
            for i in range(min(map(len, per_rank)))]


def _rounds(fns: list, dev, window_s: float, rounds: int = OVERLAP_ROUNDS) -> list[tuple[float, ...]]:
    """Seconds per call of each of ``fns`` (every rank joins each call), in ``rounds`` rounds
    of one window of about ``window_s`` per closure, round-robin. The overlap terms are
    differences of these parts (a probe's both-at-once less its parts alone): timed moments
    apart, a round's parts see the same machine, and :func:`fit_overlap` takes the median
    of the per-round terms. (Timed part after part, each the median of its own windows,
    a drift of the machine's load between the parts went whole into the difference: four
    calibrations of the development VM in one afternoon gave ring slowdowns of 0.60-3.89,
    the asynchronous one 1.18-1.53, the blocking sync 0-28 ms.)"""
    reps = [_repeats(fn, dev, window_s) for fn in fns]
    return [tuple(_window(fn, r, dev) for fn, r in zip(fns, reps)) for _ in range(rounds)]


def _overlap(dev, world: int, rounds: int | None = None, window_s: float = 0.2) -> dict:
    """This rank's ring-step times, long and tiny blocks, its P(q x q) op's (None where the
    ranks form no grid), and its asynchronous and blocking collective probes (see the module
    docstring), each a list of ``rounds`` (default ``OVERLAP_ROUNDS``) :func:`_rounds`."""
    rounds = rounds or OVERLAP_ROUNDS
    return {"long": _ring_times(dev, world, *OVERLAP_LONG, window_s, rounds),
            "tiny": _ring_times(dev, world, *OVERLAP_TINY, window_s / 2, rounds),
            "grid": _grid_times(dev, world, *OVERLAP_LONG, window_s, rounds),
            "probes": _async_and_blocking(dev, rounds)}


# The asynchronous and blocking probes (see the module docstring): GEMM blocks of
# OVERLAP_LONG's shape. Async: a 32 MiB all-reduce (a gradient bucket's, a layer's gather's
# order of size) beside 16 GEMMs (several times its time: the compute around a bucket).
# Blocking: a 4 MiB all-reduce (an activation's) after 4 GEMMs (a layer's share of compute
# between two activation collectives).
ASYNC_BYTES, ASYNC_GEMMS = 32 * 2**20, 16
SYNC_BYTES, SYNC_GEMMS, SYNC_WINDOWS = 4 * 2**20, 4, OVERLAP_ROUNDS


def _async_and_blocking(dev, rounds: int = SYNC_WINDOWS, window_s: float = 0.3) -> dict:
    """This rank's (GEMM block, collective, both) seconds of the asynchronous and the
    blocking probe (see the module docstring), in :func:`_rounds`."""
    x = torch.randn(OVERLAP_LONG[0], OVERLAP_LONG[1], device=dev)
    w = torch.randn(OVERLAP_LONG[1], OVERLAP_LONG[2], device=dev)

    def block(k):
        for _ in range(k):
            torch.mm(x, w)

    big, small = torch.ones(ASYNC_BYTES // 4, device=dev), torch.ones(SYNC_BYTES // 4, device=dev)

    def beside():
        h = dist.all_reduce(big, async_op=True)
        block(ASYNC_GEMMS)
        h.wait()

    # (each part timed alike, a window of the same call count on every rank from a barrier:
    # a GEMM block timed by each rank's own clock instead came out slower than the block
    # beside the collective, and the slowdown 0)
    def ring():
        ring_allgather_matmul(x, w, 0, dist.group.WORLD)

    return {"async": _rounds([lambda: block(ASYNC_GEMMS), lambda: dist.all_reduce(big), beside], dev, window_s,
                             rounds),
            "blocking": _rounds([lambda: block(SYNC_GEMMS), lambda: dist.all_reduce(small),
                                 lambda: (block(SYNC_GEMMS), dist.all_reduce(small))], dev, window_s / 2,
                                rounds=rounds),
            "after_ring": _rounds([ring, lambda: dist.all_reduce(small), lambda: (ring(), dist.all_reduce(small))],
                                  dev, window_s / 2, rounds=rounds)}


def fit_overlap(per_rank: list[dict], world: int | None = None) -> dict:
    """The profile's ``overlap`` from every rank's :func:`_overlap`: per round, the slowest
    rank's times (a ring, a collective, waits for its slowest member) and the terms they
    give: the ring's overhead from the tiny ring, its slowdown from the long one, the
    asynchronous collective's slowdown and the blocking one's synchronisation cost from
    their probes, all at least 0; each term the median over rounds, each part too. A
    part given as one ``(a, b, c)`` is one round. The blocking probe's synchronisation is
    the block + collective less the collective (the slowest rank's) and less the block alone
    as the typical rank (the median over ranks) ran it, the rank the planner's compute
    speaks for: the ranks' skew in reaching the collective, a rank slower all along included.
    Where the ranks ran the after-ring probe, ``ring_sync_s`` is read the same way from the
    collective right after the ring, against the ring alone as the typical rank ran it.

    The ring terms read the probe's ring as the planner costs it (``CostModel.ring``): of
    its ``world`` steps (default: one per rank given) all but the last move a block, so
    ``world * step = (world - 1) * ring_step(gemm, p2p) + ring_step(gemm, 0)``; the tiny
    ring is taken as transfer and GEMM in full, one after the other, plus the overhead."""
    W = len(per_rank) if world is None else int(world)
    if W < 2:
        raise ValueError(f"fit_overlap: a ring of {W} rank(s) moves no block; it needs at least 2")
    def per_rank_rounds(which, where=None) -> list[list[tuple[float, float, float]]]:
        rows = [r[where][which] if where else r[which] for r in per_rank]
        return [[row] if isinstance(row[0], (int, float)) else row for row in rows]  # (one round given bare)

    def slowest(which, where=None) -> list[tuple[float, float, float]]:
        return slowest_rounds(per_rank_rounds(which, where))

    def med(rounds, i):
        return statistics.median(r[i] for r in rounds)

    tiny, long = slowest("tiny"), slowest("long")
    overhead = statistics.median(max(0.0, (W * step - (W - 1) * (g + c) - g) / W) for g, c, step in tiny)
    ring_slowdown = statistics.median(
        max(0.0, (W * step - W * overhead - (W - 1) * max(g, c) - g) / ((W - 1) * min(g, c))) for g, c, step in long)
    out = {"slowdown": ring_slowdown, "ring_slowdown": ring_slowdown, "ring_step_overhead_s": overhead,
           "rounds": len(long), "ring_ranks": W,
           "long": {"gemm_s": med(long, 0), "p2p_s": med(long, 1), "ring_step_s": med(long, 2),
                    "shape": list(OVERLAP_LONG)},
           "tiny": {"gemm_s": med(tiny, 0), "p2p_s": med(tiny, 1), "ring_step_s": med(tiny, 2),
                    "shape": list(OVERLAP_TINY)}}
    if all(r.get("grid") for r in per_rank):
        out["grid"] = fit_grid([r["grid"] for r in per_rank], overhead, W)
        out["grid_slowdown"] = out["grid"]["slowdown"]
    if all("probes" in r for r in per_rank):
        rounds = slowest("async", "probes")
        out["slowdown"] = statistics.median(max(0.0, (both - max(g, c)) / min(g, c)) for g, c, both in rounds)
        # (each round's parts kept: the term is the median of the rounds' terms, which the
        # parts' medians do not give back)
        out["async"] = {"gemms_s": med(rounds, 0), "all_reduce_s": med(rounds, 1), "both_s": med(rounds, 2),
                        "bytes": ASYNC_BYTES, "gemms": ASYNC_GEMMS, "rounds_s": [list(r) for r in rounds]}
        rounds = slowest("blocking", "probes")
        # the block alone as the typical rank ran it (the median over ranks, per round): the
        # planner's compute is the typical rank's (the GEMM rates are medians over ranks), and
        # the block beside the collective waits each time for the slowest; measured against the
        # slowest rank's block alone, a rank that ran slower all window long went unseen
        # (the figure is the skew at this probe's block, SYNC_GEMMS GEMMs between collectives:
        # a rank's lag grows with the compute between two meetings, which the planner's one
        # figure per blocking collective does not follow)
        per = per_rank_rounds("blocking", "probes")
        typical = [statistics.median(row[i][0] for row in per) for i in range(len(rounds))]
        out["collective_sync_s"] = statistics.median(max(0.0, both - t - c) for (_, c, both), t in zip(rounds, typical))
        out["blocking"] = {"gemms_s": med(rounds, 0), "all_reduce_s": med(rounds, 1), "both_s": med(rounds, 2),
                           "gemms_typical_s": statistics.median(typical), "reference": "typical rank",
                           "bytes": SYNC_BYTES, "gemms": SYNC_GEMMS, "rounds_s": [list(r) for r in rounds],
                           "typical_gemms_rounds_s": typical}
    if all("after_ring" in r.get("probes", {}) for r in per_rank):
        # the same collective right after an AG ring of the long blocks, against the ring alone
        # as the typical rank ran it: the skew left where the ranks met at the ring's last
        # exchange, one GEMM step before (``CostModel.blocking``'s ``after_ring``)
        rounds = slowest("after_ring", "probes")
        per = per_rank_rounds("after_ring", "probes")
        typical = [statistics.median(row[i][0] for row in per) for i in range(len(rounds))]
        out["ring_sync_s"] = statistics.median(max(0.0, both - t - c) for (_, c, both), t in zip(rounds, typical))
        out["after_ring"] = {"ring_s": med(rounds, 0), "all_reduce_s": med(rounds, 1), "both_s": med(rounds, 2),
                             "ring_typical_s": statistics.median(typical), "bytes": SYNC_BYTES,
                             "shape": list(OVERLAP_LONG), "rounds_s": [list(r) for r in rounds],
                             "typical_ring_rounds_s": typical}
    return out


def fit_grid(per_rank: list[list[tuple[float, float, float]]], overhead_s: float, world: int) -> dict:
    """The profile's ``overlap.grid`` from every rank's :func:`_grid_times` rounds, read as the
    planner costs a P(q x q) op (``CostModel.ring`` with ``grid_overlap_slowdown``): 3q steps,
    each its GEMM and, where it moves blocks, ``slowdown`` times their transfer beside it
    (the probe's GEMMs outlast its transfers), and the step's overhead (``overhead_s``, the
    tiny ring's). So slowdown = (op - GEMMs - 3q overheads) / transfers, per round the slowest
    rank's parts, at least 0; the median over rounds, each part's too."""
    q = grid_side(world)
    if q is None:
        raise ValueError(f"fit_grid: {world} ranks form no P(2^k x 2^k) grid; it needs 4, 16, 64, ... ranks")
    rounds = slowest_rounds(per_rank)
    slowdown = statistics.median(max(0.0, (op - g - 3 * q * overhead_s) / c) for g, c, op in rounds)
    return {"slowdown": slowdown, "gemms_s": statistics.median(r[0] for r in rounds),
            "transfers_s": statistics.median(r[1] for r in rounds), "op_s": statistics.median(r[2] for r in rounds),
            "grid": q, "shape": list(OVERLAP_LONG), "rounds": len(rounds), "rounds_s": [list(r) for r in rounds]}


def _worker(rank: int, world: int, task: dict) -> dict | None:
    """One rank of a calibration run (started by ``runtime.launch.spawn``); rank 0 returns
    the result."""
    dev = torch.device("cuda", rank) if task["backend"] == "nccl" else torch.device("cpu")
    result: dict = {"samples": []}
    if task.get("amend"):  # --amend: only the probes named
        got = {}
        for probe in task["amend"]:
            if probe == "collectives":  # (timed on every rank; rank 0's samples are the slowest rank's)
                got[probe] = _time_collectives(task, rank, world, dev)
                continue
            gathered = [None] * world
            dist.all_gather_object(gathered, AMENDABLE[probe][0](dev, task.get("rounds")))
            got[probe] = gathered
        return got if rank == 0 else None
    if task.get("matmul"):
        dist.barrier()
        rates = _matmul_rates(dev)
        bw = _mem_bw(dev)
        overlap = _overlap(dev, world, task.get("rounds"))
        ops = {}
        # CPU profiles only: on a GPU a probe this size times its launch, not its kernel, and
        # the caching allocator hands a copy warm blocks
        if dev.type == "cpu":
            ops = _op_times(dev)
            ops[COPY_OP] = _fresh_copy(dev)
            ops.update(_optimizer_steps(dev))
        batched = _batched_block(dev, task.get("rounds"))
        fresh = _fresh_alloc(dev, task.get("rounds")) if dev.type == "cpu" else None  # (CUDA's caching allocator keeps blocks)
        gathered = [None] * world
        dist.all_gather_object(gathered, {"matmul": rates, "mem_bw": bw, "overlap": overlap, "ops": ops,
                                          "batched": batched, "fresh": fresh})
        result["per_rank"] = gathered
    result.update(_time_collectives(task, rank, world, dev))
    return result if rank == 0 else None


def _time_collectives(task: dict, rank: int, world: int, dev) -> dict:
    """``samples``: (kind, nbytes, seconds) of every kind and size of ``task`` on all ranks;
    ``group_samples``: the same on each of ``task["group_sizes"]`` (P2P aside)."""
    cases = [(kind, nbytes) for kind in task["kinds"] for nbytes in task["sizes"]]
    fns = [_collective_fn(kind, nbytes, rank, world, dev) for kind, nbytes in cases]
    secs = _time_ops(fns, task["iters"], dev)
    out = {"samples": [[kind, nbytes, t] for (kind, nbytes), t in zip(cases, secs)], "group_samples": {}}
    for n in task.get("group_sizes", []):
        # every rank joins every new_group call, in the same order; each times its own group
        groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
        mine = groups[rank // n]
        sub = [(kind, nbytes) for kind, nbytes in cases if kind != "p2p"]  # (a P2P is a pair already)
        secs = _time_ops([_collective_fn(kind, nbytes, rank, world, dev, mine) for kind, nbytes in sub],
                         task["iters"], dev)
        out["group_samples"][str(n)] = [[kind, nbytes, t] for (kind, nbytes), t in zip(sub, secs)]
    return out


def run_spawned(world_size: int, task: dict, timeout_s: float) -> dict:
    """Run ``_worker`` on ``world_size`` fresh processes (``runtime.launch.spawn``); return
    rank 0's result. Every child is gone when this returns or raises."""
    # Ranks share the cores: give each its share so they do not oversubscribe.
    threads = max(1, (os.cpu_count() or 1) // world_size)
    try:
        return spawn(_worker, world_size, task, timeout_s=timeout_s, backend=task["backend"],
                     threads_per_rank=threads)[0]
    except SpawnTimeout:
        raise RuntimeError(f"calibration on {world_size} {task['backend']} ranks did not finish within "
                           f"{timeout_s:.0f} s; all ranks were killed. Fix: use fewer --sizes or a larger "
                           f"--timeout") from None


def measure_collectives(world_size: int = 4, sizes=DEFAULT_SIZES, kinds=KINDS, iters: int = COLLECTIVE_ITERS,
                        backend: str | None = None, timeout_s: float = 300.0) -> list[tuple[str, int, float]]:
    """Fresh (kind, nbytes, seconds) samples, measured like ``calibrate`` does."""
    task = {"backend": backend or _default_backend(world_size), "kinds": list(kinds),
            "sizes": [int(s) for s in sizes], "iters": iters, "matmul": False}
    return [tuple(s) for s in run_spawned(world_size, task, timeout_s)["samples"]]


def transfer_samples(ks: list[tuple[str, float, float]], n: int, device: DeviceSpec | None) -> list[tuple]:
    """(kind, nbytes, seconds) samples on groups of ``n`` ranks less their output's first
    touch where ``device``'s allocator maps a block that size fresh (``CostModel._made``
    charges it again on top of the fitted line): the lines fit the transfer alone, which the
    jump at glibc's mmap cap does not bend (on the development VM an all-gather into 33 MiB
    took 68 ms, into 31 MiB 34 ms). A sample its part would leave at nothing or less (the two
    probes' noise) is kept whole."""
    if device is None:
        return list(ks)
    out = []
    for kind, nb, t in ks:
        made = fresh_alloc_time(device, collective_output_bytes(kind, nb, n))
        out.append((kind, nb, t - made if t > made else t))
    return out


def _fit_kind(ks: list[tuple[str, float, float]], n: int, device: DeviceSpec | None = None) -> dict:
    """A profile's entry for one collective kind from its (kind, nbytes, seconds) samples on
    groups of ``n`` ranks: the least-squares line and the bands, fitted to the samples less
    their fresh output's first touch (:func:`transfer_samples`); the samples as measured."""
    fit = transfer_samples(ks, n, device)
    alpha, bw, err = fit_alpha_beta(fit, n)
    return {"alpha_s": alpha, "bw_bytes_per_s": bw, "rel_rms": err,
            "samples": [[nb, t] for _, nb, t in ks], "bands": fit_bands(fit, n)}


def refit_collectives(profile: dict) -> None:
    """Fit every collective entry of ``profile`` (the node's, each group size's, the joint
    link) again from its stored samples, less the fresh outputs' first touch its device has
    (after an amendment gave it the figures)."""
    device = device_spec(profile["device"])
    world = int(profile["ranks"])
    samples = []
    for kind, entry in profile["collectives"].items():
        ks = [(kind, float(nb), float(t)) for nb, t in entry["samples"]]
        entry.update(_fit_kind(ks, world, device))
        samples += ks
    for n, kinds in profile.get("group_collectives", {}).items():
        for kind, entry in kinds.items():
            entry.update(_fit_kind([(kind, float(nb), float(t)) for nb, t in entry["samples"]], int(n), device))
    if samples:
        alpha, bw, err = fit_alpha_beta(transfer_samples(samples, world, device), world)
        profile["link"] = {"alpha_s": alpha, "bw_bytes_per_s": bw, "rel_rms": err}


def _default_backend(world_size: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


# ----------------------------------------------------------------------------- profile


def calibrate(world_size: int = 4, out: str | None = "profile.json", sizes=DEFAULT_SIZES,
              kinds=KINDS, iters: int = COLLECTIVE_ITERS, backend: str | None = None,
              timeout_s: float = 600.0, rounds: int | None = None) -> dict:
    """Measure, fit and (if ``out``) write a calibration profile; returns the profile dict.
    ``rounds``: of every probe timed in rounds (default: each probe's own)."""
    if world_size < 2:
        raise ValueError("calibration needs at least 2 ranks to time collectives")
    if len(sizes) < 2:
        raise ValueError("need at least two message sizes to fit alpha and beta")
    backend = backend or _default_backend(world_size)
    facts = {p.op: probe_facts(p) for p in PROBES}  # (first: a probe torch traces otherwise fails at once)
    task = {"backend": backend, "kinds": list(kinds), "sizes": [int(s) for s in sizes],
            "iters": iters, "matmul": True, "group_sizes": sub_group_sizes(world_size), "rounds": rounds}
    res = run_spawned(world_size, task, timeout_s)
    samples = [tuple(s) for s in res["samples"]]

    # Device: per dtype the large-GEMM rate of the line through its sizes' median-over-ranks
    # times; the fp32 line's intercept is the GEMM ramp.
    per_rank = res["per_rank"]
    rows = []
    for i, row in enumerate(per_rank[0]["matmul"]):
        secs = [r["matmul"][i]["seconds"] for r in per_rank]
        sec = statistics.median(secs)
        rows.append({**row, "seconds": sec, "flops_per_s": 2.0 * row["m"] * row["n"] * row["k"] / sec})
    curves = {dt: fit_gemm_curve([r for r in rows if r["dtype"] == dt]) for dt in MATMUL_DTYPES}
    peak = {dt: rate for dt, (rate, _) in curves.items()}
    # tf32 is a CUDA matmul mode; elsewhere fp32 runs at the fp32 rate.
    peak["tf32"] = peak["fp32"]
    if backend == "nccl":
        dev_name = torch.cuda.get_device_name(0)
        mem_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        dev_name = "cpu"
        mem_bytes = get_device("CPU").mem_bytes
    device = {"name": f"calibrated-{dev_name}", "peak_flops": peak, "efficiency": 1.0,
              "gemm_ramp_s": curves["fp32"][1], "gemm_ramps": {dt: ramp for dt, (_, ramp) in curves.items()},
              "mem_bw": statistics.median(r["mem_bw"] for r in per_rank), "mem_bytes": mem_bytes}
    # Ops that are not GEMMs: measured forward + backward over the roofline the planner charges.
    measured = {op: statistics.median(r["ops"][op] for r in per_rank) for op in per_rank[0]["ops"]}
    copy_s = measured.pop(COPY_OP, None)
    opt_s = {op: measured.pop(op) for op in OPTIMIZER_PROBES if op in measured}
    ops = fit_op_slowdown(measured, facts, DeviceSpec(device["name"], peak, device["mem_bw"], mem_bytes, 1.0))
    if copy_s:  # the runtime's copies into new buffers against the warm copy's rate
        roof = 2.0 * COPY_BYTES / device["mem_bw"]
        ops[COPY_OP] = {"measured_s": copy_s, "roofline_s": roof, "slowdown": copy_s / roof}
    ops.update(fit_optimizer(opt_s, device["mem_bw"]))  # the optimizer steps against their bytes' roofline
    device["op_slowdown"] = {op: r["slowdown"] for op, r in ops.items()}
    batched = fit_batched([r["batched"] for r in per_rank])
    device["batch_reread_bw"] = batched["batch_reread_bw"]
    device["batch_reread_cached_bytes"] = batched["batch_reread_cached_bytes"]
    fresh = fit_fresh([r["fresh"] for r in per_rank], fresh_alloc_threshold()) if per_rank[0]["fresh"] else None
    if fresh:
        device["fresh_alloc_bytes"], device["fresh_page_bw"] = fresh["fresh_alloc_bytes"], fresh["fresh_page_bw"]
    spec = device_spec(device)  # (the collectives' fresh outputs)

    collectives = {kind: _fit_kind([s for s in samples if s[0] == kind], world_size, spec) for kind in kinds}
    # the same kinds on each smaller group (every group of consecutive ranks at once)
    groups = {n: {kind: _fit_kind([tuple(x) for x in got if x[0] == kind], int(n), spec)
                  for kind in kinds if kind != "p2p"}
              for n, got in res.get("group_samples", {}).items()}
    alpha, bw, err = fit_alpha_beta(transfer_samples(samples, world_size, spec), world_size)
    profile = {"version": 1, "name": f"calibrated-{socket.gethostname()}-{backend}-{world_size}",
               "backend": backend, "ranks": world_size, "torch": torch.__version__,
               "device": device, "matmul": rows, "ops": ops, "batched_gemm": batched,
               **({"fresh_alloc": fresh} if fresh else {}),
               "link": {"alpha_s": alpha, "bw_bytes_per_s": bw, "rel_rms": err},
               "collectives": collectives, "group_collectives": groups, "overlap": fit_overlap([r["overlap"] for r in per_rank], world_size)}
    if out:
        save_profile(profile, out)
    return profile


def _amend_batched(profile: dict, per_rank: list) -> str:
    batched = fit_batched(per_rank)
    profile["batched_gemm"] = batched
    profile["device"]["batch_reread_bw"] = batched["batch_reread_bw"]
    profile["device"]["batch_reread_cached_bytes"] = batched["batch_reread_cached_bytes"]
    return batched_line(batched)


def _amend_fresh(profile: dict, per_rank: list) -> str:
    fresh = fit_fresh(per_rank, fresh_alloc_threshold())
    profile["fresh_alloc"] = fresh
    profile["device"]["fresh_alloc_bytes"] = fresh["fresh_alloc_bytes"]
    profile["device"]["fresh_page_bw"] = fresh["fresh_page_bw"]
    refit_collectives(profile)  # (their lines: the samples less the fresh outputs, as calibrate fits them)
    return fresh_line(fresh) + "; the collectives' lines fitted again to their samples less it"


def overlap_line(ov: dict) -> str:
    """One line of the profile's ``overlap`` entry (:func:`fit_overlap`)."""
    return (f"overlap: compute beside an asynchronous collective slows by {ov['slowdown']:.2f} of the "
            f"collective's time, beside a ring step's transfer by {ov['ring_slowdown']:.2f}"
            + (f", beside a P(2^k x 2^k) op's by {ov['grid_slowdown']:.2f}" if "grid_slowdown" in ov else "")
            + f"; a ring step's overhead "
            f"{ov['ring_step_overhead_s'] * 1e6:.0f} us; a blocking collective's synchronisation "
            f"{ov.get('collective_sync_s', 0.0) * 1e3:.2f} ms"
            + (f", right after a ring {ov['ring_sync_s'] * 1e3:.2f} ms" if "ring_sync_s" in ov else ""))


def _measure_overlap(dev, rounds: int | None = None) -> dict:
    return _overlap(dev, dist.get_world_size(), rounds)


def _measure_grid(dev, rounds: int | None = None):
    return _grid_times(dev, dist.get_world_size(), *OVERLAP_LONG, 0.2, rounds or OVERLAP_ROUNDS)


def _amend_grid(profile: dict, per_rank: list) -> str:
    """The P(q x q) op's figure into ``profile["overlap"]``, against the ring step's overhead
    there (the default's where the profile has none); the rest of the overlap kept."""
    ov = profile.setdefault("overlap", {})
    ov["grid"] = fit_grid(per_rank, float(ov.get("ring_step_overhead_s", RING_STEP_OVERHEAD_S)), int(profile["ranks"]))
    ov["grid_slowdown"] = ov["grid"]["slowdown"]
    return grid_line(ov["grid"])


def grid_line(g: dict) -> str:
    """One line of the profile's ``overlap.grid`` entry (:func:`fit_grid`)."""
    return (f"a P({g['grid']}x{g['grid']}) op's forward + backward on {'x'.join(map(str, g['shape']))} blocks: "
            f"{g['op_s'] * 1e3:.1f} ms against its GEMMs' {g['gemms_s'] * 1e3:.1f} ms and its transfers' "
            f"{g['transfers_s'] * 1e3:.1f} ms alone: compute beside its transfers slows by {g['slowdown']:.2f} "
            f"of their time")


def _op_times(dev, rounds: int | None = None) -> dict[str, float]:
    """Seconds of each op probe's forward + backward (``calibrate_ops.PROBES``), every rank at
    once, each kept busy for its window (``rounds`` is not used: a window, not rounds)."""
    return {p.op: _sustained(probe_step(p, dev), dev, window_s=0.3) for p in PROBES}


def _amend_ops(profile: dict, per_rank: list) -> str:
    """Every op probe's slowdown fitted again (the median over ranks against the roofline of
    the profile's device) and written over the profile's: a probe added since the profile was
    measured (gelu's tanh approximation, the fifty-second session) gets its figure. The
    runtime's copies and the optimizer step keep theirs (probes of their own)."""
    measured = {op: statistics.median(r[op] for r in per_rank) for op in per_rank[0]}
    dev = profile["device"]
    ops = fit_op_slowdown(measured, {p.op: probe_facts(p) for p in PROBES},
                          DeviceSpec(dev["name"], dev["peak_flops"], dev["mem_bw"], dev["mem_bytes"], 1.0))
    new = [op for op in ops if op not in profile.get("ops", {})]
    profile.setdefault("ops", {}).update(ops)
    dev.setdefault("op_slowdown", {}).update({op: r["slowdown"] for op, r in ops.items()})
    return (f"ops that are not GEMMs: {len(ops)} probes timed again"
            + (f" (new: {', '.join(new)})" if new else "") + "; slowdown over the roofline "
            + ", ".join(f"{op.removeprefix('aten.')} {r['slowdown']:.2f}" for op, r in ops.items()))


def _amend_optimizer(profile: dict, per_rank: list) -> str:
    """The AdamW steps (foreach and fused; the fused one is new since the fifty-seventh
    session) timed again and fitted against the profile's ``mem_bw``."""
    measured = {op: statistics.median(r[op] for r in per_rank) for op in per_rank[0]}
    ops = fit_optimizer(measured, profile["device"]["mem_bw"])
    profile.setdefault("ops", {}).update(ops)
    profile["device"].setdefault("op_slowdown", {}).update({op: r["slowdown"] for op, r in ops.items()})
    return "the optimizer step: " + ", ".join(
        f"AdamW {OPTIMIZER_PROBES[op]} {r['measured_s'] * 1e3:.1f} ms, {r['slowdown']:.2f}x its roofline"
        for op, r in ops.items())


def _amend_overlap(profile: dict, per_rank: list) -> str:
    profile["overlap"] = fit_overlap(per_rank)
    return overlap_line(profile["overlap"])


def sampled_sizes(profile: dict) -> list[int]:
    """The message sizes ``profile``'s collectives were sampled at, in order."""
    return sorted({int(nb) for entry in profile["collectives"].values() for nb, _ in entry["samples"]})


def missing_sizes(profile: dict) -> list[int]:
    """The sizes of :data:`DEFAULT_SIZES` at which ``profile``'s collectives have no sample."""
    have = set(sampled_sizes(profile))
    return [n for n in DEFAULT_SIZES if n not in have]


def amend_sizes(profile: dict) -> list[int]:
    """The sizes the collectives probe times into ``profile``: none where it has every size of
    the default grid (or no collective entry); else the grid and the profile's own sizes, all
    timed again. (Sizes timed alone are not the calibration's: on the development VM 40 MiB
    all-gathers timed with the 24 MiB ones alone took 131-148 ms, 92-97 ms among the whole
    grid, in full calibrations, ``measure_collectives`` and this probe alike; so no old
    sample is kept beside new ones.)"""
    if not profile["collectives"] or not missing_sizes(profile):
        return []
    return sorted(set(sampled_sizes(profile)) | set(DEFAULT_SIZES))


def merge_samples(profile: dict, got: dict) -> None:
    """Write ``got``'s (kind, nbytes, seconds) samples (:func:`_time_collectives`: the world's
    and each group size's) into ``profile``'s entries of the same kind and group, in size
    order, a sample at a size the entry has replacing it; then fit every line again."""
    def add(entry: dict, rows) -> None:
        by_size = {int(nb): t for nb, t in entry["samples"]}
        by_size.update({int(nb): t for _, nb, t in rows})
        entry["samples"] = [[nb, by_size[nb]] for nb in sorted(by_size)]

    for kind, entry in profile["collectives"].items():
        add(entry, [r for r in got["samples"] if r[0] == kind])
    for n, rows in got["group_samples"].items():
        for kind, entry in profile.get("group_collectives", {}).get(n, {}).items():
            add(entry, [r for r in rows if r[0] == kind])
    refit_collectives(profile)


def _amend_collectives(profile: dict, got: dict) -> str:
    sizes = sorted({int(nb) for _, nb, _ in got["samples"]})
    if not sizes:
        return ("collectives: nothing measured (the profile has every size of the default grid, or no "
                "collective entry)")
    new = missing_sizes(profile)
    merge_samples(profile, got)
    at = {kind: t for kind, nb, t in got["samples"] if nb == sizes[-1]}
    groups = ", ".join(f"groups of {n}" for n in got["group_samples"])
    return (f"collectives timed again at {len(sizes)} sizes, {_size_text(sizes[0])} .. {_size_text(sizes[-1])} "
            f"(new: {', '.join(_size_text(n) for n in new)}), on {profile['ranks']} ranks"
            f"{' and ' + groups if groups else ''} ({_size_text(sizes[-1])}: "
            + ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in at.items())
            + "); every line and band fitted again")


def _size_text(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 1 << 20 else f"{n / 2**10:g} KiB"


# The probes ``--amend`` can measure into an older profile: name -> (each rank's measurement,
# how its ranks' results go into the profile, returning a line saying what was written). The
# collectives' (None: every rank times them together, :func:`_time_collectives`): where the
# profile lacks a size of the default grid, the whole grid (:func:`amend_sizes`) at every kind
# and group size it has.
AMENDABLE = {"batched_gemm": (_batched_block, _amend_batched), "fresh_alloc": (_fresh_alloc, _amend_fresh),
             "collectives": (None, _amend_collectives), "overlap": (_measure_overlap, _amend_overlap),
             "grid": (_measure_grid, _amend_grid),
             "ops": (_op_times, _amend_ops), "optimizer": (_optimizer_steps, _amend_optimizer)}
# The probes that measure CPU ranks only: a GPU's caching allocator keeps blocks (fresh_alloc),
# and an op probe this size times its kernel's launch, not the kernel (ops, optimizer).
CPU_ONLY = ("fresh_alloc", "ops", "optimizer")


def amendable_probes(backend: str) -> tuple[str, ...]:
    """The probes ``--amend`` measures into a profile of ``backend``'s ranks unless told which:
    all of them on CPU (gloo) ranks; on GPU (NCCL) ranks all but :data:`CPU_ONLY`; the grid's
    alone never (the overlap probe measures it too)."""
    return tuple(p for p in AMENDABLE if p != "grid" and (backend == "gloo" or p not in CPU_ONLY))


def amend(path: str, probes=None, timeout_s: float = 600.0, rounds: int | None = None) -> list[str]:
    """Measure ``probes`` (names in :data:`AMENDABLE`; None: :func:`amendable_probes` of the
    profile's backend) into the profile at ``path``, written before they had their present
    form, on as many ranks as it was measured with, and note the amendment of each; returns
    a line per probe saying what it wrote. The fresh allocation probe measures a CPU profile
    only; the collectives probe, where the profile lacks a size of the default grid, times
    the whole grid again (:func:`amend_sizes`) on every kind and group size it has and fits
    its lines again (:func:`merge_samples`). ``rounds``: as :func:`calibrate`'s."""
    profile = read_profile(path)
    world = int(profile["ranks"])
    backend = profile.get("backend", "gloo")
    probes = amendable_probes(backend) if probes is None else tuple(probes)
    unknown = [p for p in probes if p not in AMENDABLE]
    if unknown:
        raise ValueError(f"unknown probe(s) {unknown}: choose from {sorted(AMENDABLE)}")
    if "grid" in probes and grid_side(world) is None:
        raise ValueError(f"{path} was measured on {world} ranks, which form no P(2^k x 2^k) grid: the grid probe "
                         "runs on 4, 16, 64, ... ranks. Fix: leave it out")
    cpu_only = [p for p in probes if p in CPU_ONLY]
    if cpu_only and backend != "gloo":
        what = f"the {cpu_only[0]} probe measures" if len(cpu_only) == 1 else \
            f"the {' and '.join(cpu_only)} probes measure"
        raise ValueError(f"{path} was measured on {backend} ranks: {what} CPU ranks. "
                         "Fix: leave them out (--probe NAME for the others)")
    sizes = amend_sizes(profile) if "collectives" in probes else []
    kinds = list(profile["collectives"])
    measured = [p for p in probes if p != "collectives" or sizes]  # (the grid complete: nothing to time)
    task = {"backend": backend, "amend": measured, "kinds": kinds, "sizes": sizes, "iters": COLLECTIVE_ITERS,
            "group_sizes": [int(n) for n in profile.get("group_collectives", {})], "rounds": rounds}
    got = run_spawned(world, task, timeout_s) if measured else {}
    got.setdefault("collectives", {"samples": [], "group_samples": {}})
    lines = []
    for probe in probes:
        lines.append(AMENDABLE[probe][1](profile, got[probe]))
        if probe not in measured:
            continue
        profile.setdefault("amended", []).append(
            {"probe": probe, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "host": socket.gethostname(), "torch": torch.__version__, "ranks": world,
             **({"sizes": sizes} if probe == "collectives" else {})})
    save_profile(profile, path)
    return lines


def batched_line(b: dict) -> str:
    """One line of the batched-block probe's profile entry (:func:`fit_batched`)."""
    parts = [f"{'x'.join(map(str, e['shape']))} {e['batched_s'] * 1e3:.2f} ms against {e['rows_s'] * 1e3:.2f} ms"
             for e in (b, b["small"])]
    bw = b["batch_reread_bw"]
    return (f"batched blocks {' and '.join(parts)} as one 2-D GEMM: "
            + (f"the weight re-read at {bw / 1e9:.2f} GB/s past the first "
               f"{b['batch_reread_cached_bytes'] / 2**20:.2f} MiB, which the cache serves" if bw else "no extra cost"))


def _parse_size(given: str) -> int:
    text = given.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if mult > 1 else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {given.strip()!r}. Fix: use e.g. 256K, 4M, 65536") from None


@verb
def main_calibrate(argv: list[str]) -> int:
    """``python -m stpc calibrate [--json profile.json] [--ranks 4] [--sizes 256K,4M,64M]``."""
    ap = Parser("python -m stpc calibrate", "Measure matmul and collective performance on this machine and write\n"
                "a cost-model profile (JSON): give it to --cluster of plan, demo and bench.\n\n"
                "Exit codes: 0 written, 1 the measurement failed, 2 a usage error.")
    add_flags(ap, {"ranks": {"default": 4, "note": "at least 2"}, "timeout": {"default": 600.0, "shown": "600"},
                   "json": {"default": "profile.json", "note": "the profile", "aliases": ["--out"]}})
    ap.add_argument("--sizes", default=None,
                    help="comma-separated message sizes, e.g. 64K,1M,16M (default: 64 KiB..64 MiB, powers "
                         "of 4 and 24M, 40M)")
    ap.add_argument("--iters", type=int, default=COLLECTIVE_ITERS,
                    help=f"timed windows per size (default: {COLLECTIVE_ITERS})")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                    help="default: nccl when enough GPUs, else gloo")
    ap.add_argument("--amend", metavar="PROFILE", default=None,
                    help="measure only the probes --probe names into PROFILE, a profile written before they "
                         "had their present form, on its number of ranks")
    ap.add_argument("--probe", action="append", choices=sorted(AMENDABLE), default=None,
                    help="with --amend: a probe to measure (repeatable; default: all of them, on an NCCL "
                         "profile all but fresh_alloc and ops)")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"rounds of each probe timed in rounds, the overlap, batched-block and fresh-allocation "
                         f"probes (default: their own, {OVERLAP_ROUNDS}, {BATCHED_ROUNDS} and {FRESH_ROUNDS}; "
                         f"fewer: quicker and noisier)")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    if args.probe and not args.amend:
        ap.error("--probe: only with --amend PROFILE. Fix: add --amend PROFILE, or drop --probe (a full "
                 "calibration measures every probe)")
    if args.amend:
        if not os.path.exists(args.amend):
            ap.error(f"--amend {args.amend}: no such profile. Fix: give a profile `python -m stpc calibrate` wrote")
        probes = tuple(dict.fromkeys(args.probe)) if args.probe else None
        with Status(f"calibrate: measuring {', '.join(probes or ['the amendable probes'])} into {args.amend}",
                    not args.quiet):
            try:
                lines = amend(args.amend, probes, timeout_s=args.timeout, rounds=args.rounds)
            except ValueError as exc:
                raise Failure(str(exc).rstrip("."), "amend a profile calibrate measured on gloo ranks") from None
        print(args.amend if args.quiet else "\n".join(f"amended {args.amend}: {line}" for line in lines))
        return 0
    if args.ranks < 2:
        ap.error(f"--ranks {args.ranks}: calibration needs at least 2 ranks to time collectives. Fix: --ranks 2 "
                 "or more")
    try:
        sizes = [_parse_size(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    except argparse.ArgumentTypeError as exc:
        ap.error(f"--sizes: {exc}")
    if len(sizes) < 2:
        ap.error("--sizes: need at least two message sizes to fit alpha and beta. Fix: give two or more")
    if args.iters < 1:
        ap.error(f"--iters {args.iters}: give 1 or more")
    try:
        with Status(f"calibrate: {args.ranks} ranks measuring", not args.quiet):
            prof = calibrate(args.ranks, args.json, sizes=sizes, iters=args.iters, backend=args.backend,
                             timeout_s=args.timeout, rounds=args.rounds)
    except ValueError as exc:  # e.g. nccl asked for with too few GPUs
        raise Failure(str(exc).rstrip("."), "see `python -m stpc calibrate --help`") from None
    if args.quiet:
        print(args.json)
        return 0
    print(f"wrote {args.json} ({prof['backend']}, {prof['ranks']} ranks)")
    print("| collective | alpha (us) | bandwidth (GB/s) | fit rms rel. error |")
    print("|---|---|---|---|")
    for kind, c in prof["collectives"].items():
        print(f"| {kind} | {c['alpha_s'] * 1e6:.1f} | {c['bw_bytes_per_s'] / 1e9:.3f} | {c['rel_rms']:.1%} |")
    print("| matmul dtype | large-GEMM GFLOP/s per rank |")
    print("|---|---|")
    for dt, v in prof["device"]["peak_flops"].items():
        print(f"| {dt} | {v / 1e9:.1f} |")
    for dt, ramp in prof["device"]["gemm_ramps"].items():
        print(f"GEMM ramp ({dt}): {ramp * 1e6:.1f} us beyond the large-GEMM rate (half that rate at "
              f"{ramp * prof['device']['peak_flops'][dt] / 1e6:.1f} MFLOP)")
    print("| op (not a GEMM) | forward + backward ms | planner's roofline ms | slowdown |")
    print("|---|---|---|---|")
    for op, r in prof["ops"].items():
        print(f"| {op} | {r['measured_s'] * 1e3:.2f} | {r['roofline_s'] * 1e3:.2f} | {r['slowdown']:.2f} |")
    print(batched_line(prof["batched_gemm"]))
    print(overlap_line(prof["overlap"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main_calibrate(sys.argv[1:]))
