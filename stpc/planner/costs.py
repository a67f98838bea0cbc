"""Costs of strategies and of resharding, from ``stpc.cost_models`` (time from its
compute and communication models, bytes from its ``MemoryModel``).

Every number is modelled seconds (or bytes) for one training step:
forward + backward (dI) + gradient (dW) phases.

Resharding along an edge, per mesh axis, from the producer's token ``p`` to the
token ``q`` the consumer needs, for a tensor of ``nbytes`` (already divided by
the splits on the other axes); forward cost plus the cost of its autograd dual
in backward (only when the tensor needs a gradient). On an edge out of a parameter
both overlap with compute (``cost_models.overlap``; the builder applies it):

  p -> q            forward            backward
  same              -                  all-reduce if q is R and the consumer splits
                                       its work on this axis (Megatron's "f")
  R -> S/grid       local slice        all-gather
  R -> P            local (rank 0)     -
  S -> R            all-gather         reduce-scatter if the consumer splits, else slice
  S -> S', grid     all-to-all of      the same        (runtime.redistribute: what
                    the overlaps                         each rank's new piece lacks)
  P -> R            all-reduce         all-reduce if the consumer splits its work
  P -> S/grid       reduce-scatter     all-gather
  B -> X (same dims) one P2P skew      one P2P skew   (PrimePar: next layer's input)
  S/grid -> P       via R: all-gather  as S -> R

A parameter's edge S/grid -> R or P (ZeRO-3 / FSDP: stored sharded, read whole) costs one
more all-gather in backward (``regather``): the runtime does not keep whole parameters
from forward to backward and gathers them again there, as FSDP2 does by default
(``stpc.runtime.RegatherSaved``). Not on the axes a plan keeps gathered weights over
(ZeRO-2, ``Hints.keep_gathered``): there the whole copy is memory saved for backward
(:func:`kept_gathered_bytes`) instead. A parameter's edge to a split it does not hold
(S -> S', R -> S/grid) is a redistribution the runtime waits on where it stands, forward
and backward (only gathers are prefetched and gradient sums bucketed): charged blocking,
not overlapped (``Builder._param_edge``). A weight planned in a skewed grid layout pays its
relayout from the stored blocks on the parameter (:func:`grid_relayout_s`).

A dim split over several axes whose outer split changes (tokens S1, S0 -> S0, S0) is costed as
the per-axis sum too: the all-to-all of the outer axis, nothing on the inner one. The runtime
makes it one redistribution over the axes' joint group (``insert_collectives.reshard_steps``),
each rank receiving the part of its new block it lacks (on 2x2, half its block from each of
two ranks), not the one axis's exchange the table charges: a named simplification (the
per-axis edges cannot see the other axes). Before, it gathered the inner axis whole and split
it again, which the model did not charge at all.

Where the device's allocator maps blocks of ``DeviceSpec.fresh_alloc_bytes`` or more fresh at
every allocation (glibc on a CPU), every tensor a node makes of that size (its output, its
operands' gradients) and every copy into a new buffer pays its first touch
(``CostModel.fresh``); so does every collective's output (``CostModel._made``: the lines of
a calibration profile are fitted to its samples less that part).
"""
from __future__ import annotations

import math

import torch

from stpc.cost_models import CostModel, MemoryModel
from stpc.cost_models.compute import GELU_TANH_OP, MASKED_ATTENTION_OP
from stpc.placement import REPLICATE, dims_split, local_shape, parse, received_fraction, shard_factor
from stpc.planner.strategies import Strategy, aten, tensor_operands

_MATMUL = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default}
# Per-row statistics a norm kept in a grid layout exchanges along the grid row, each way
_GRID_NORM_STATS = {aten.layer_norm.default: 2, aten.rms_norm.default: 1}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def axis_reshard_phases(cm: CostModel, axis: int, p: str, q: str, nbytes: float, consumer_split: bool,
                        needs_grad: bool, regather: bool = False,
                        messages: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(forward, backward) seconds to turn token ``p`` into ``q`` on one axis: the forward
    collective and its autograd dual (the table in the module docstring); ``regather``: a
    parameter gathered whole is gathered again in backward. ``messages``: for a parameter,
    the bytes of the coalesced collectives its synchronisation rides in on this axis (its
    data-parallel gradient's bucket, its ZeRO layer's one gather and reduce-scatter;
    ``CostModel.coalesced``), 0 for a collective of its own."""
    if cm.mesh_shape[axis] == 1:
        return 0.0, 0.0
    bucket, layer = messages
    if p == q:
        return 0.0, (cm.coalesced("all_reduce", nbytes, axis, bucket)
                     if (q == REPLICATE and consumer_split and needs_grad) else 0.0)
    pk, qk = p[0], q[0]
    if pk == "R":
        return 0.0, (cm.all_gather(nbytes, axis) if (qk != "P" and needs_grad) else 0.0)
    if pk == "P":
        if qk == "R":
            # A consumer that splits its work hands back a Partial gradient: reduce it too.
            ar = cm.all_reduce(nbytes, axis)
            return ar, (ar if (consumer_split and needs_grad) else 0.0)
        return cm.reduce_scatter(nbytes, axis), (cm.all_gather(nbytes, axis) if needs_grad else 0.0)
    # p is a split (S or a grid token)
    if qk in "RP":
        bwd = cm.coalesced("reduce_scatter", nbytes, axis, layer) if (consumer_split or qk == "P") else 0.0
        ag = cm.coalesced("all_gather", nbytes, axis, layer)
        return ag, ((bwd + (ag if regather else 0.0)) if needs_grad else 0.0)
    if pk == "B" and qk == "X" and parse(p)[1] == parse(q)[1]:
        step = cm.p2p(nbytes / cm.mesh_shape[axis], axis)
        return step, (step if needs_grad else 0.0)
    # split to split: runtime.redistribute moves each rank only what its new piece lacks
    # (an all-to-all's (n-1)/n between plain splits of two dims)
    a2a = cm.all_to_all(nbytes, axis, received_fraction(p, q, cm.mesh_shape[axis]))
    return a2a, (a2a if needs_grad else 0.0)


def param_copy_phases(cm: CostModel, axis: int, p: str, q: str, nbytes: float, consumer_split: bool,
                      needs_grad: bool, regather: bool = False, kept_bucket: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of the copies the runtime makes around a parameter's
    collectives on one axis, on the rank's own thread (no overlap; ``CostModel.copy``).
    A weight stored split and read whole (ZeRO): the gathered buffer cut into the whole
    parameter (``runtime.param_gather._cut``), in forward and again for backward's
    re-gather, and its gradient laid out rank-major for the reduce-scatter
    (``_rank_major``). A replicated weight whose gradient is summed (data parallelism): the
    gradient copied into its bucket (``runtime.grad_reducer``), into memory touched before
    where the runtime keeps its buckets between steps (``kept_bucket``,
    ``MemoryModel.kept_buckets``: no first touch, ``CostModel.fresh``). (A group of one parameter
    split on its first dim is cut as a view, no copy: charged alike, a named simplification.)"""
    if cm.mesh_shape[axis] == 1:
        return 0.0, 0.0
    pk, qk = p[0], q[0]
    if p == q == REPLICATE:
        return 0.0, (cm.copy(nbytes) - (cm.fresh(nbytes) if kept_bucket else 0.0) if consumer_split and needs_grad
                     else 0.0)
    if pk not in "RP" and qk in "RP":
        cut = cm.copy(nbytes)
        if not needs_grad:
            return cut, 0.0
        return cut, (2 if regather else 1) * cut  # (cut again for the re-gather; the gradient laid out)
    return 0.0, 0.0


def grid_relayout_s(cm: CostModel, placement: tuple[str, ...], nbytes: float, needs_grad: bool) -> float:
    """Seconds a parameter planned in a skewed grid layout (X or W) costs each step to read. It
    is stored as the plain blocks B over the same dims (no DTensor placement says a skew,
    ``runtime.dtensors.stored``), and every call relays this rank's block to the skewed one
    by one P2P exchange per such axis before the program runs
    (``runtime.dtensors.to_plan_layout``), and its gradient back in backward.
    The forward exchanges run back to back in the call's feed, where the ranks meet once:
    charged their transfers alone. So do the backward ones: the feed made their autograd
    nodes before every op of the program, and autograd runs the newest ready node first,
    so they run last, back to back, after the rest of backward (the ranks' one meeting
    there, at the first of them, left out: a named simplification)."""
    local = nbytes / shard_factor(placement, cm.mesh_shape)
    steps = [cm.p2p(local, a) for a, tok in enumerate(placement) if tok[0] in "XW"]
    return sum(steps) * (2 if needs_grad else 1)


def axis_reshard(cm: CostModel, axis: int, p: str, q: str, nbytes: float, consumer_split: bool,
                 needs_grad: bool, replayed: bool = False, since_meeting_s: float | None = None) -> float:
    """Seconds to turn token ``p`` into ``q`` on one axis, forward plus backward dual: an
    activation's, which every rank waits on where it runs (``CostModel.blocking``).
    ``replayed``: inside a recomputed layer, whose forward runs again in backward. Into a
    skewed grid token (X, W: only a P(2^k x 2^k) op reads one), the dual runs where that
    op's backward hands back the gradient, the ranks having met at its last exchange
    (``after_ring``). ``since_meeting_s``: the producer's forward ended that many seconds of
    compute after the ranks of this axis met (``NodeTimer.meeting_tail``): the forward
    collective is charged the skew that compute leaves."""
    fwd, bwd = axis_reshard_phases(cm, axis, p, q, nbytes, consumer_split, needs_grad)
    return (cm.blocking(fwd, since_meeting_s=since_meeting_s) * (2 if replayed else 1)
            + cm.blocking(bwd, after_ring=q[0] in "XW"))


def reshard_cost(cm: CostModel, src: tuple[str, ...], dst: tuple[str, ...], full_bytes: float,
                 consumer_split: tuple[bool, ...], needs_grad: bool) -> float:
    """Seconds to reshard a tensor of ``full_bytes`` from ``src`` to ``dst`` (sum over axes),
    kept in ``cm.memo`` (a search asks one model the same reshards for every problem it
    builds on that mesh shape: bloom-7b1's on 8 devices, 128 thousand calls, 3.6 thousand
    distinct)."""
    if src == dst and not any(consumer_split):
        return 0.0
    key = ("reshard_cost", src, dst, full_bytes, consumer_split, needs_grad)
    got = cm.memo.get(key)
    if got is None:
        got = cm.memo[key] = _reshard_cost(cm, src, dst, full_bytes, consumer_split, needs_grad)
    return got


def _reshard_cost(cm: CostModel, src: tuple[str, ...], dst: tuple[str, ...], full_bytes: float,
                  consumer_split: tuple[bool, ...], needs_grad: bool) -> float:
    mesh = cm.mesh_shape
    total = 0.0
    for a in range(len(mesh)):
        if src[a] == dst[a] and not (dst[a] == REPLICATE and consumer_split[a]):
            continue
        nbytes = full_bytes / shard_factor(src, mesh, skip_axis=a)
        total += axis_reshard(cm, a, src[a], dst[a], nbytes, consumer_split[a], needs_grad)
    return total


def _work_split(s: Strategy, mesh) -> int:
    return math.prod(n for n, sp in zip(mesh, s.split_axes()) if sp)


def slowdown_key(node) -> str:
    """The name ``node``'s measured slowdown goes under (``DeviceSpec.op_slowdown``): its aten
    op, or a variant that runs other kernels: ``MASKED_ATTENTION_OP`` for attention given a
    mask, ``GELU_TANH_OP`` for gelu's tanh approximation."""
    if node.target is aten.scaled_dot_product_attention.default and (
            (len(node.args) > 3 and node.args[3] is not None) or node.kwargs.get("attn_mask") is not None):
        return MASKED_ATTENTION_OP
    if node.target is aten.gelu.default and (
            node.args[1] if len(node.args) > 1 else node.kwargs.get("approximate", "none")) == "tanh":
        return GELU_TANH_OP
    return str(node.target)


class NodeTimer:
    """Modelled seconds of one node under a strategy (``timer(s)``): forward, backward
    (dI) and gradient (dW) phases; temporal families include their overlapped ring
    transfers. The phase times depend on the strategy only through how finely it
    splits the work, so they are computed once per split (the planner asks for every
    strategy of every decision node)."""

    def __init__(self, node, cm: CostModel, operand_grad: list[bool]):
        self.node, self.cm, self.mesh = node, cm, cm.mesh_shape
        val = node.meta["val"]
        self.dt = dtype_name(val.dtype) if isinstance(val, torch.Tensor) else "fp32"
        self.flops = node.meta.get("flops", 0)
        self.moved = node.meta.get("bytes_read", 0) + node.meta.get("bytes_written", 0)
        self.matmul = node.target in _MATMUL
        self.op = slowdown_key(node)
        self.grad_in = bool(operand_grad and operand_grad[0])
        self.grad_w = len(operand_grad) > 1 and operand_grad[1]
        self.needs_bwd = any(operand_grad)
        self.operand_grad = list(operand_grad)
        self._phases: dict[int, tuple[float, float, float]] = {}
        self._spatial: dict[tuple, float] = {}   # split flags per axis -> spatial seconds
        self._arg_nbytes: dict[int, int] = {}    # positional tensor argument -> its bytes
        self._times: dict[tuple, float] = {}     # (strategy, forward only) -> seconds
        self.out_bytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0

    def _arg_bytes(self, i: int) -> int:
        got = self._arg_nbytes.get(i)
        if got is None:
            v = self.node.args[i].meta["val"]
            got = self._arg_nbytes[i] = v.numel() * v.element_size()
        return got

    def phases(self, split: int) -> tuple[float, float, float]:
        """Seconds of each phase when the work is split ``split`` ways (a ring's step is a
        further split: a GEMM that size, on the device's efficiency curve)."""
        got = self._phases.get(split)
        if got is None:
            flops, moved = self.flops / split, self.moved / split
            if self.matmul:
                fwd = self.cm.gemm(flops, moved, self.dt)
                bwd = fwd if self.grad_in else 0.0
                grad = fwd if self.grad_w else 0.0
            else:
                fwd = self.cm.compute(flops, moved, self.dt, self.op)
                bwd = self.cm.compute(flops, 2 * moved, self.dt, self.op) if self.needs_bwd else 0.0
                grad = 0.0
            got = self._phases[split] = (fwd, bwd, grad)
        return got

    def windows(self, s: Strategy) -> tuple[float, float]:
        """(forward, backward) compute seconds a parameter's collectives may hide behind
        (``cost_models.overlap``): a spatial strategy's phase times; none for a temporal
        family, whose compute already hides its ring transfers."""
        if s.kind != "spatial" and s.kind != "replicate-fallback":
            return 0.0, 0.0
        fwd, bwd, grad = self.phases(_work_split(s, self.mesh))  # (memoised per split)
        return fwd, bwd + grad

    def grid_statistics(self, s: Strategy, forward_only: bool = False) -> float:
        """A LayerNorm kept in a grid layout (``runtime.grid_layer_norm``) exchanges per-row
        statistics along the grid row: an all-gather over the axis of 2 values per local row
        forward (mean, M2) and again backward (two sums), each waited on where it runs. An
        RMSNorm (``runtime.grid_rms_norm``) exchanges one value per row each way (the sum of
        squares; the sum of the gradient times the normalised input)."""
        if self.node.target is aten.cross_entropy_loss.default:
            return self._grid_loss_statistics(s)
        per_row = _GRID_NORM_STATS.get(self.node.target)
        if per_row is None:
            return 0.0
        for a, tok in enumerate(s.out):
            if tok[0] == "B":
                val = self.node.meta["val"]
                # this device's rows: its share less the grid columns' split of the last dim
                rows = val.numel() // val.shape[-1] * math.isqrt(self.mesh[a]) / shard_factor(s.out, self.mesh)
                width = max(4, val.element_size())  # (statistics in fp32 at least)
                stats = self.cm.blocking(self.cm.all_gather(self.mesh[a] * rows * per_row * width, a))
                return stats * (1 if forward_only or not self.needs_bwd else 2)
        return 0.0

    def meeting_tail(self, s: Strategy) -> tuple[float | None, ...] | None:
        """Per mesh axis, where this node's forward under ``s`` ends a known compute after the
        ranks of that axis met, that compute's seconds (None on the other axes); None where
        it ends after no meeting. A norm kept in a grid layout (``runtime.grid_layer_norm``,
        ``grid_rms_norm``) all-gathers its per-row statistics over the axis of its B token,
        every rank waiting on it, then normalises its block: a reshard of its output follows
        that normalisation only. Charged as the node's whole forward compute there (the
        statistics' own pass before the exchange included: an upper bound)."""
        if self.node.target not in _GRID_NORM_STATS or s.kind not in ("spatial", "replicate-fallback"):
            return None
        for a, tok in enumerate(s.out):
            if tok[0] == "B" and self.mesh[a] > 1:
                fwd = self.phases(_work_split(s, self.mesh))[0]
                return tuple(fwd if b == a else None for b in range(len(self.mesh)))
        return None

    def _grid_loss_statistics(self, s: Strategy) -> float:
        """A cross-entropy reading its logits in a grid layout (``runtime.grid_cross_entropy``)
        exchanges row statistics along the grid row, forward only: the row maxima (1 value
        per local row), then the sums of exponentials and the targets' logits (2), each an
        all-gather over the axis waited on where it runs."""
        for a, tok in enumerate(s.ins[0]):
            if tok[0] == "B":
                val = self.node.args[0].meta["val"]
                rows = val.shape[0] * math.isqrt(self.mesh[a]) / shard_factor(s.ins[0], self.mesh)
                width = max(4, val.element_size())
                return sum(self.cm.blocking(self.cm.all_gather(self.mesh[a] * rows * k * width, a)) for k in (1, 2))
        return 0.0

    def _batched(self, s: Strategy, ring_token: str, fwd: float, bwd: float) -> tuple[float, float]:
        """A ring step's forward and input-gradient GEMMs when its block does not fold to
        rows: the ring splits x's rows on dim m (``ring_token``), and where x's dims before m
        hold more than one element locally, the runtime runs each step as a GEMM batched over
        them with the weight shared (``runtime.ops.kernels.ring_step_matmul``), which reads
        the weight again per batch element (``CostModel.batched_gemm_extra``). The weight
        gradient's GEMM is 2-D (rows of x against rows of dO)."""
        if self.cm.device.batch_reread_bw is None:  # (the presets: no such cost; spare the planner the shapes)
            return fwd, bwd
        m = dims_split(ring_token)[0]
        batch = math.prod(local_shape(tuple(self.node.args[0].meta["val"].shape), s.ins[0], self.mesh)[:m])
        extra = self.cm.batched_gemm_extra(batch, self._arg_bytes(1) / shard_factor(s.ins[1], self.mesh))
        return fwd + extra, (bwd + extra if bwd > 0 else bwd)

    def __call__(self, s: Strategy) -> float:
        return self._time(s, forward_only=False)

    def forward(self, s: Strategy) -> float:
        """Seconds of the forward phase alone under ``s`` (what replaying it costs: a
        recomputed layer's ops run forward again in backward, ``passes.recompute``)."""
        return self._time(s, forward_only=True)

    def fresh(self, s: Strategy, forward_only: bool = False) -> float:
        """Seconds the tensors this node makes under ``s`` cost beyond writing them where the
        device's allocator maps blocks their size fresh each time (``CostModel.fresh``): its
        local output, and in backward each operand's gradient at the placement it is read in
        (0 on a device whose allocator caches every size: the presets)."""
        cm = self.cm
        if cm.device.fresh_page_bw is None:
            return 0.0
        t = cm.fresh(self.out_bytes / shard_factor(s.out, self.mesh))
        if not forward_only:
            for o, g, p in zip(tensor_operands(self.node), self.operand_grad, s.ins):
                if g:
                    v = o.meta["val"]
                    t += cm.fresh(v.numel() * v.element_size() / shard_factor(p, self.mesh))
        return t

    def _time(self, s: Strategy, forward_only: bool) -> float:
        key = (s, forward_only)
        got = self._times.get(key)
        if got is None:
            got = self._times[key] = self._compute_time(s, forward_only) + self.fresh(s, forward_only)
        return got

    def _compute_time(self, s: Strategy, forward_only: bool) -> float:
        mesh, cm = self.mesh, self.cm
        if forward_only and (s.kind == "spatial" or s.kind == "replicate-fallback"):
            return self.phases(_work_split(s, mesh))[0] + self.grid_statistics(s, forward_only=True)
        split = s.split_axes()
        if s.kind == "spatial" or s.kind == "replicate-fallback":  # a function of the split alone
            got = self._spatial.get(split)
            if got is None:
                got = self._spatial[split] = sum(self.phases(_work_split(s, mesh)))
            return got + self.grid_statistics(s)
        a = s.axis
        n = mesh[a]
        x_local = self._arg_bytes(0) / shard_factor(s.ins[0], mesh)
        out_local = self.out_bytes / shard_factor(s.out, mesh)
        # Each family as its runtime op runs it (``runtime.ops.ring``): a ring of n blocks moves
        # n - 1 of them (``CostModel.ring``), blocks posted together share a step.
        if s.kind == "ag_ring":
            # fwd: n steps of 1/n of the device's GEMMs, an x block moving beside each but the
            # last. bwd + grad: one loop of two rings, the x blocks again (for dW) and the dI
            # accumulators, to the same peer: step 0 moves an x block, the last step an
            # accumulator, each step between both.
            fwd, bwd, grad = self.phases(_work_split(s, mesh) * n)
            fwd, bwd = self._batched(s, s.ins[0][a], fwd, bwd)
            block = cm.p2p(x_local, a)
            forward = cm.ring(fwd, [block] * (n - 1) + [0.0])
            if forward_only:
                return forward
            both = cm.p2p(2 * x_local, a)
            return forward + cm.ring(bwd + grad, [block] + [both] * (n - 2) + [block])
        if s.kind == "rs_ring":
            # fwd: the output's accumulator blocks travel, from the second step on; bwd + grad:
            # one AG ring over dO blocks feeding both GEMMs of each step.
            fwd, bwd, grad = self.phases(_work_split(s, mesh) * n)
            fwd, bwd = self._batched(s, s.out[a], fwd, bwd)
            block = cm.p2p(out_local, a)
            forward = cm.ring(fwd, [0.0] + [block] * (n - 1))
            if forward_only:
                return forward
            return forward + cm.ring(bwd + grad, [block] * (n - 1) + [0.0])
        if s.kind == "p2x2":
            g = math.isqrt(n)
            fwd, bwd, grad = self.phases(_work_split(s, mesh) * g)
            w_local = self._arg_bytes(1) / shard_factor(s.ins[1], mesh)
            # g steps a phase, g - 1 of them moving two blocks to two grid neighbours at once
            # (fwd: I and W; bwd: dO and W; grad: I and dO). The gradient phase's first step
            # also carries the dI shift (one x block to a third neighbour, posted as the phase
            # begins), its last the dW accumulator (a weight block, beside the last GEMM).
            # (beside a grid's steps compute slows by the grid's own measured figure)
            peers, slow = cm.p2p_to_peers, cm.grid_overlap_slowdown
            forward = cm.ring(fwd, [peers((x_local, w_local), a)] * (g - 1) + [0.0], slow)
            if forward_only:
                return forward
            backward = cm.ring(bwd, [peers((out_local, w_local), a)] * (g - 1) + [0.0], slow)
            gradient = cm.ring(grad, [peers((x_local, out_local, x_local), a)]
                               + [peers((x_local, out_local), a)] * (g - 2) + [peers((w_local,), a)], slow)
            return forward + backward + gradient
        raise ValueError(f"unknown strategy family {s.kind!r}")


# Ops that materialise working copies of their first operand beyond their output: one aten
# op whose kernel allocates intermediates of that operand's (local) size. The loss is the
# last op of forward and the first of backward, with every saved activation alive for both,
# so its working set at the end of forward is the larger of the two. Forward,
# cross_entropy_loss computes log_softmax of the logits (kept for backward): one copy.
# Backward holds the logits' gradient beside the log-probabilities: one copy where the
# logits reach the loss as they were computed. Measured on one GPU (RESULTS, CUDA: the
# fidelity bench's GPT at batch 16 on an H100 and an H200, no reshard before the loss): the
# CUDA allocator's peak is the model's with one copy, within 2% (eager).
WORKING_COPIES = {aten.cross_entropy_loss.default: 1}
# ... and where its first operand reaches it through a redistribution (an edge whose
# producer holds another placement than the op reads, a grid layout among them, or a view
# before it that cannot keep its input's layout, ``Builder._transient_edges``), the head's
# backward passes that gradient back through the reshard's dual while it is alive: one
# copy more. A reshard of all-to-alls only (one plain split into another) holds none: the
# runtime frees each exchange's send buffer once it is done (``runtime.reshard._release``,
# twelfth session). Read off the fidelity bench's peaks (4 gloo ranks, 16 MiB of logits
# per rank, profile 18, thirteenth session): the megatron plan's vocab-parallel logits
# all-to-all'd to a row split, +3.4% with the copy, -0.1% without (the runtime bench's
# 2x2 solved plan, alike: +10.4% and -0.1%); the p2x2 plan's grid logits redistributed,
# -4.6% with it, -7.9% without. (Before ``_release`` the megatron plan's peak held the
# all-to-all's backward send buffer too, and the copy was charged there.)
RESHARD_COPIES = {aten.cross_entropy_loss.default: 1}


def transient_bytes(node, strategies, mesh, memory: MemoryModel) -> list[float]:
    """Per strategy, the node's working set while it runs (``MemoryModel.transient_bytes``):
    its local operands and output, the working copies of its first operand it allocates
    (``WORKING_COPIES``), plus the double-buffered ring blocks (blocks of its first operand)
    of a temporal family."""
    val = node.meta["val"]
    out = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
    ins = [o.meta["val"].numel() * o.meta["val"].element_size() for o in tensor_operands(node)]
    copies = WORKING_COPIES.get(node.target, 0)
    # runtime.grid_cross_entropy works in fp32 at least: with 16-bit logits its working copy
    # is two of theirs, and backward holds it beside the 16-bit gradient it returns
    grid_copies = copies
    if node.target is aten.cross_entropy_loss.default and tensor_operands(node)[0].meta["val"].element_size() < 4:
        grid_copies = 3
    sizes = []
    for s in strategies:
        local_ins = [nb / shard_factor(p, mesh) for nb, p in zip(ins, s.ins)]
        ring = 0.0 if s.kind in ("spatial", "replicate-fallback") else local_ins[0]
        in_grid = bool(local_ins) and any(t[0] == "B" for t in s.ins[0])
        work = (grid_copies if in_grid else copies) * local_ins[0] if local_ins else 0.0
        sizes.append(memory.transient_bytes(local_ins, (out / shard_factor(s.out, mesh) if out else 0) + work,
                                            ring))
    return sizes


def grad_bytes(node, strategies, mesh, grads) -> list[float]:
    """Per strategy, the gradients the op's backward computes for its operands that need one
    (``grads``: per tensor operand), each at the placement the op reads it in: the working
    set of a head op's backward beyond what forward saved (its output's gradient takes the
    place of what the loss saved and its backward freed)."""
    ops = tensor_operands(node)
    sizes = [o.meta["val"].numel() * o.meta["val"].element_size() for o in ops]
    return [sum(nb / shard_factor(p, mesh) for nb, p, g in zip(sizes, s.ins, grads) if g) for s in strategies]


def ring_backward_bytes(node, strategies, mesh) -> list[float]:
    """Per strategy, the working set of a P(2^k x 2^k) op's backward (``stpc::
    primepar_linear_backward``, q = 2^k): in its gradient phase, while the dI block shifts
    to its owner, it holds two dO blocks (the receive buffers the backward phase filled,
    reused), dI and dX (activation blocks), min(q - 1, 2) activation blocks in flight, the
    dW accumulator, the partial received from the neighbour and dW itself (weight blocks):
    its operands' gradients included. 0 for every other family (their backward's working
    set is their gradients, ``grad_bytes``). What the op's backward allocates, to the byte
    (``tests/test_reshard_memory.py``; the fidelity bench's grid plan measured the head's at
    80 MiB, this 62 MiB, until the sixty-third session took off the zeros autograd made for
    the stashes' gradients and a spent weight receive buffer the gradient phase held)."""
    ops = tensor_operands(node)
    val = node.meta["val"]
    sizes = [o.meta["val"].numel() * o.meta["val"].element_size() for o in ops[:2]]
    out = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
    res = []
    for s in strategies:
        if s.kind != "p2x2":
            res.append(0.0)
            continue
        q = math.isqrt(mesh[s.axis])
        x_b, w_b = (nb / shard_factor(p, mesh) for nb, p in zip(sizes, s.ins))
        o_b = out / shard_factor(s.out, mesh)
        res.append(2 * o_b + (2 + min(q - 1, 2)) * x_b + 3 * w_b)
    return res


def grad_reduction_bytes(stored, read, split_axes, nbytes: float, mesh, staging: int) -> float:
    """Bytes the runtime holds to reduce a parameter's gradient, beyond the gradient its
    reader computed (at ``read``, the placement the reader reads it in), while that
    reduction is in flight; the parameter is stored at ``stored``, ``nbytes`` whole.

    * stored split on one axis and read whole there, alike elsewhere (ZeRO / FSDP,
      ``passes.prefetch_params``: its layer's gradients reduce-scattered in one collective):
      the gradient laid out rank-major (``runtime.param_gather._rank_major``), the
      backend's staging copy of it (``staging``, ``Cluster.gather_staging``: gloo 1 — the
      fidelity bench's ag_rs plan holds 72 MiB in ``_GatherWaitBackward`` for a 32 MiB head
      weight on 4 ranks: 32 + 32 + 8 — NCCL 0) and the reduced shard;
    * stored and read replicated on an axis the reader splits its work on (data
      parallelism, ``runtime.GradReducer``): the gradient's copy in its bucket;
    * otherwise nothing: a gradient read as stored is complete, and a parameter gathered
      over several axes is reduced by a chain of collectives whose buffers this leaves out
      (a named simplification)."""
    if any(m > 1 and read[a] != REPLICATE and read[a] != stored[a] for a, m in enumerate(mesh)):
        return 0.0
    grad = nbytes / shard_factor(read, mesh)
    differ = [a for a, m in enumerate(mesh) if m > 1 and stored[a] != read[a]]
    if len(differ) == 1 and stored[differ[0]] != REPLICATE:
        return grad * (1 + staging) + grad / mesh[differ[0]]
    if not differ and any(m > 1 and read[a] == REPLICATE and split_axes[a] for a, m in enumerate(mesh)):
        return grad
    return 0.0


def stash_bytes(node, strategies, mesh, needs_grad: bool) -> list[float]:
    """Per strategy, what the op itself keeps for backward beyond the tensors the graph
    saves (``analysis.saved_bases``, charged to their owners): P(2^k x 2^k) keeps the last
    activation and weight blocks its ring received (``stpc::primepar_linear``'s ``x_stash``
    and ``w_stash``, new buffers, one local block of each), which backward restarts from;
    nothing for every other family. Nothing when no operand needs a gradient."""
    if not needs_grad:
        return [0.0] * len(strategies)
    ops = tensor_operands(node)
    sizes = [o.meta["val"].numel() * o.meta["val"].element_size() for o in ops[:2]]
    return [sum(nb / shard_factor(p, mesh) for nb, p in zip(sizes, s.ins)) if s.kind == "p2x2" else 0.0
            for s in strategies]


def kept_gathered_bytes(val, placement, mesh, axes) -> float:
    """Bytes of a parameter's whole copy kept from forward to backward under ZeRO-2
    (``Hints.keep_gathered``): gathered over ``axes`` where its placement splits it there,
    still split as placed on the other axes; 0 when it is whole on every one of ``axes``."""
    if not any(placement[a] != REPLICATE for a in axes):
        return 0.0
    rest = math.prod(n for a, (n, t) in enumerate(zip(mesh, placement)) if t != REPLICATE and a not in axes)
    return val.numel() * val.element_size() / rest


__all__ = ["grid_relayout_s", "grad_bytes", "ring_backward_bytes", "grad_reduction_bytes", "WORKING_COPIES", "RESHARD_COPIES", "param_copy_phases", "kept_gathered_bytes", "reshard_cost", "NodeTimer", "transient_bytes", "axis_reshard", "axis_reshard_phases", "dtype_name"]
