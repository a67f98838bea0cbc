"""Ring-decomposed distributed matmuls as ``torch.library`` custom ops.

Plain differentiable distributed functions: they know nothing of plans or
graphs. Each op takes its process group as ``group_name: str`` (as the
functional collectives do) so it is a pure, schema-describable op that
``torch.compile`` treats as opaque; fake kernels give it correct shapes and
its backward is its dual ring schedule, itself a custom op.

Ops (namespace ``stpc``; Python wrappers below take a group or its name):

``ring_allgather_matmul(x, w, gather_dim, group_name) -> out``
    ``out = all_gather(x, gather_dim) @ w`` as an AG-ring.
``ring_matmul_reducescatter(x, w, scatter_dim, group_name) -> out``
    ``out = reduce_scatter(x @ w, scatter_dim)`` as an RS-ring.
``primepar_linear(x, w, group_name, k) -> (out, x_stash, w_stash)``
    PrimePar's P(2^k x 2^k) linear layer (layouts in its docstring).

Ring conventions (P ranks, this rank ``i`` = group rank): every block moves
from rank ``i+1`` to rank ``i`` (receive from "next", send to "prev").

* AG-ring: at step t rank i holds x block ``(i+t) % P`` (its own at t=0),
  multiplies it into output slice ``(i+t) % P`` and passes it on. The transfer
  that feeds step t+1 is posted *before* step t's matmul and waited after it
  (double buffering), so P-1 transfers hide behind P matmuls.
* RS-ring: at step t rank i computes the partial product of output block
  ``(i+t+1) % P``, adds the accumulator for that block received from rank i+1
  (which computed it at step t-1) and sends the sum to rank i-1. At the last
  step (t = P-1) the block is ``i``: the fully reduced local output. The
  accumulator's transfer overlaps the partial matmul of the same step.

All blocks of a ring have the same shape on every rank (as with
``all_gather_into_tensor``); the scattered dim must divide by P.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from stpc.runtime.failure import comm_failure
from stpc.runtime.ops.kernels import ring_step_matmul

__all__ = [
    "ring_allgather_matmul",
    "ring_matmul_reducescatter",
    "primepar_linear",
    "primepar_coords",
    "primepar_shard_input",
    "primepar_shard_weight",
    "primepar_shard_output",
    "primepar_unshard_input",
    "primepar_unshard_weight",
    "primepar_unshard_output",
    "group_name_of",
    "ring_peers",
    "primepar_peers",
]

# P2P tags: different streams to the same peer in one batch must not be
# confused (with 2 ranks, or a 2x2 grid, "prev" and "next" are the same rank).
_TAG_A, _TAG_B, _TAG_C, _TAG_D = 0, 1, 2, 3


# --------------------------------------------------------------------------- helpers


def group_name_of(group: dist.ProcessGroup | str | None) -> str:
    """The name the custom ops take: None -> the default (WORLD) group."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first")
    return group.group_name


def _post(group: dist.ProcessGroup, sends=(), recvs=()) -> list:
    """Start P2P transfers. sends/recvs: (tensor, group_peer, tag) triples.

    Returns the works to wait on; waiting on the sends as well as the receives
    is what makes it safe to reuse a sent buffer in a later step.
    """
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=p, tag=tag) for t, p, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=p, tag=tag) for t, p, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


_OP_NAMES = {"_ring_allgather_matmul": "stpc::ring_allgather_matmul (AG-ring)",
             "_ring_allgather_matmul_backward": "stpc::ring_allgather_matmul's backward rings",
             "_ring_matmul_reducescatter": "stpc::ring_matmul_reducescatter (RS-ring)",
             "_ring_matmul_reducescatter_backward": "stpc::ring_matmul_reducescatter's backward ring",
             "_primepar_linear": "stpc::primepar_linear (P2x2 steps)",
             "_primepar_linear_backward": "stpc::primepar_linear's backward steps"}


def _failing_op() -> str:
    """The ring op whose step is waiting (read off the stack, only when a wait failed)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name in _OP_NAMES:
            return _OP_NAMES[f.f_code.co_name]
        f = f.f_back
    return "a ring op"


def _wait(works: list) -> None:
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:
        raise comm_failure(f"{_failing_op()}, a step's P2P transfer", None, e) from e


def _norm_dim(dim: int, ndim: int, what: str) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim - 1:
        raise ValueError(
            f"{what}={dim} must name a non-contraction dim of a {ndim}-D input "
            f"(the last dim is the contraction dim)"
        )
    return d


def _split3(shape, d: int) -> tuple[int, int, int]:
    """(prod of dims before d, prod of dims d..-2, last dim): the 3-D view in
    which a slice along dim d is a contiguous range of the middle dim."""
    return math.prod(shape[:d]), math.prod(shape[d:-1]), shape[-1]


def _rows_block(t3: Tensor, j: int, rows: int) -> Tensor:
    return t3[:, j * rows:(j + 1) * rows, :]


def _flat2(t: Tensor) -> Tensor:
    """[pre, rows, c] -> [pre*rows, c] (a view when possible)."""
    return t.reshape(-1, t.shape[-1])


# --------------------------------------------------------------------------- AG-ring


def ring_peers(i: int, P: int) -> tuple[int, int]:
    """(send-to, receive-from) of group rank ``i`` in every step of a ring of ``P``: blocks
    move from rank i+1 to rank i. The one rule the ring ops and ``passes.verify`` share."""
    return (i - 1) % P, (i + 1) % P


def primepar_peers(rank: int, k: int) -> list[tuple[int, int, int]]:
    """(send-to, receive-from, tag) of each transfer of one forward step of P(2^k x 2^k) on
    group rank ``rank``: I moves along the grid row from (r, c+1), W along the grid column
    from (r+1, c). The one rule ``_primepar_linear`` and ``passes.verify`` share."""
    q = 2 ** k
    r, c = divmod(rank, q)
    return [(_pp_peer(q, r, c - 1), _pp_peer(q, r, c + 1), _TAG_A),
            (_pp_peer(q, r - 1, c), _pp_peer(q, r + 1, c), _TAG_B)]


def _ring_pass(group: dist.ProcessGroup, block: Tensor, tag: int = _TAG_A):
    """Yield ``(src, cur)`` P times: ``cur`` is rank ``src``'s block. Blocks move from
    rank i+1 to rank i; the next block's transfer is posted before the caller's loop
    body runs on ``cur`` (the compute hides the transfer) and awaited after it.
    Receives alternate between two buffers, never the caller's tensor."""
    P, i = group.size(), group.rank()
    prev, nxt = ring_peers(i, P)
    bufs = [torch.empty_like(block) for _ in range(min(P - 1, 2))]
    cur = block
    for t in range(P):
        works = []
        if t < P - 1:
            recv = bufs[t % 2]
            works = _post(group, sends=[(cur, prev, tag)], recvs=[(recv, nxt, tag)])
        yield (i + t) % P, cur
        _wait(works)
        if t < P - 1:
            cur = recv


@torch.library.custom_op("stpc::ring_allgather_matmul", mutates_args=())
def _ring_allgather_matmul(x: Tensor, w: Tensor, gather_dim: int, group_name: str) -> Tensor:
    group = _resolve_process_group(group_name)
    P = group.size()
    g = _norm_dim(gather_dim, x.dim(), "gather_dim")
    pre, R, n = _split3(x.shape, g)
    k = w.shape[1]
    x3 = x.reshape(pre, R, n).contiguous()
    # w as given, any strides (a linear's weight comes transposed, W.t()): every GEMM takes it
    # so, where a contiguous copy cost a copy of the weight per call
    out3 = x.new_empty(pre, P * R, k)
    for src, cur in _ring_pass(group, x3):
        ring_step_matmul(cur, w, _rows_block(out3, src, R), accumulate=False)
    return out3.view(*x.shape[:g], P * x.shape[g], *x.shape[g + 1:-1], k)


@_ring_allgather_matmul.register_fake
def _(x, w, gather_dim, group_name):
    P = dist.distributed_c10d._get_group_size_by_name(group_name)
    g = _norm_dim(gather_dim, x.dim(), "gather_dim")
    shape = list(x.shape)
    shape[g] = shape[g] * P
    shape[-1] = w.shape[1]
    return x.new_empty(shape)


@torch.library.custom_op("stpc::ring_allgather_matmul_backward", mutates_args=())
def _ring_allgather_matmul_backward(
    grad_out: Tensor, x: Tensor, w: Tensor, gather_dim: int, group_name: str
) -> tuple[Tensor, Tensor]:
    """(dx, dw) of ``out = all_gather(x) @ w``, one fused loop of two rings:

    * dx = reduce_scatter(dOut @ w^T): RS-ring over accumulators,
    * dw = all_gather(x)^T @ dOut: the AG ring over x re-run, so the gathered
      x is never materialised (nor kept alive since the forward).
    Both rings move blocks i+1 -> i, so each step is one batched exchange.
    """
    group = _resolve_process_group(group_name)
    P, i = group.size(), group.rank()
    g = _norm_dim(gather_dim, x.dim(), "gather_dim")
    pre, R, n = _split3(x.shape, g)
    k = w.shape[1]
    x3 = x.reshape(pre, R, n).contiguous()
    go3 = grad_out.reshape(pre, P * R, k).contiguous()
    wT = w.t()
    prev, nxt = ring_peers(i, P)

    dw = torch.empty_like(w)  # w's layout: the gradient of W (w = W.t()) comes out contiguous, as W is
    x_bufs = [torch.empty_like(x3) for _ in range(min(P - 1, 2))]
    # RS accumulators: the one being computed, the one in flight, the one received
    acc, acc_sent, acc_recv = (x.new_empty(pre, R, n) for _ in range(3))
    cur_x = x3
    for t in range(P):
        sends, recvs = [], []
        if t < P - 1:
            x_recv = x_bufs[t % 2]
            sends.append((cur_x, prev, _TAG_A))
            recvs.append((x_recv, nxt, _TAG_A))
        if t > 0:
            sends.append((acc_sent, prev, _TAG_B))
            recvs.append((acc_recv, nxt, _TAG_B))
        works = _post(group, sends, recvs)
        # dw += x_blk^T @ dOut_blk for the x block held this step
        src = (i + t) % P
        ring_step_matmul(_flat2(cur_x).t(), _flat2(_rows_block(go3, src, R)), dw, accumulate=t > 0)
        # dx partial for block (i+t+1): dOut_blk @ w^T
        j = (i + t + 1) % P
        ring_step_matmul(_rows_block(go3, j, R), wT, acc, accumulate=False)
        _wait(works)
        if t > 0:
            acc.add_(acc_recv)
        if t < P - 1:
            cur_x = x_recv
            acc, acc_sent = acc_sent, acc
    return acc.view(x.shape), dw


def _register_ring_autograd(op, backward_op) -> None:
    """Both rings take (x, w, dim, group_name) and have a fused backward op returning
    (dx, dw) with x's and w's shapes: one fake kernel and one autograd rule serve both."""

    @backward_op.register_fake
    def _(grad_out, x, w, dim, group_name):
        return x.new_empty(x.shape), torch.empty_like(w)  # dw in w's layout, as the kernels make it

    def setup_context(ctx, inputs, output):
        x, w, dim, group_name = inputs
        ctx.save_for_backward(x, w)
        ctx.dim, ctx.group_name = dim, group_name

    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        dx, dw = backward_op(grad_out, x, w, ctx.dim, ctx.group_name)
        return dx, dw, None, None

    op.register_autograd(backward, setup_context=setup_context)


_register_ring_autograd(_ring_allgather_matmul, _ring_allgather_matmul_backward)


# --------------------------------------------------------------------------- RS-ring


@torch.library.custom_op("stpc::ring_matmul_reducescatter", mutates_args=())
def _ring_matmul_reducescatter(x: Tensor, w: Tensor, scatter_dim: int, group_name: str) -> Tensor:
    group = _resolve_process_group(group_name)
    P, i = group.size(), group.rank()
    g = _norm_dim(scatter_dim, x.dim(), "scatter_dim")
    _check_divisible(x.shape[g], P, "scatter_dim", scatter_dim)
    pre, RP, n = _split3(x.shape, g)
    R = RP // P
    k = w.shape[1]
    x3 = x.reshape(pre, RP, n)  # block slices are strided views: no copy
    prev, nxt = ring_peers(i, P)
    acc, acc_sent, acc_recv = (x.new_empty(pre, R, k) for _ in range(3))
    for t in range(P):
        works = []
        if t > 0:
            # the accumulator finished last step travels while we compute this one
            works = _post(group, sends=[(acc_sent, prev, _TAG_A)], recvs=[(acc_recv, nxt, _TAG_A)])
        j = (i + t + 1) % P
        ring_step_matmul(_rows_block(x3, j, R), w, acc, accumulate=False)
        _wait(works)
        if t > 0:
            acc.add_(acc_recv)
        if t < P - 1:
            acc, acc_sent = acc_sent, acc
    return acc.view(*x.shape[:g], x.shape[g] // P, *x.shape[g + 1:-1], k)


def _check_divisible(size, P: int, what: str, dim: int) -> None:
    if size % P != 0:
        raise ValueError(f"{what}={dim} has size {size}, not divisible by the group size {P}")


@_ring_matmul_reducescatter.register_fake
def _(x, w, scatter_dim, group_name):
    P = dist.distributed_c10d._get_group_size_by_name(group_name)
    g = _norm_dim(scatter_dim, x.dim(), "scatter_dim")
    _check_divisible(x.shape[g], P, "scatter_dim", scatter_dim)
    shape = list(x.shape)
    shape[g] = shape[g] // P
    shape[-1] = w.shape[1]
    return x.new_empty(shape)


@torch.library.custom_op("stpc::ring_matmul_reducescatter_backward", mutates_args=())
def _ring_matmul_reducescatter_backward(
    grad_out: Tensor, x: Tensor, w: Tensor, scatter_dim: int, group_name: str
) -> tuple[Tensor, Tensor]:
    """(dx, dw) of ``out = reduce_scatter(x @ w)``: both need all_gather(dOut);
    one AG ring over dOut feeds dx = AG(dOut) @ w^T (slice by slice) and
    dw = x^T @ AG(dOut) (accumulated), so the gathered dOut never exists."""
    group = _resolve_process_group(group_name)
    P = group.size()
    g = _norm_dim(scatter_dim, x.dim(), "scatter_dim")
    pre, RP, n = _split3(x.shape, g)
    R = RP // P
    k = w.shape[1]
    x3 = x.reshape(pre, RP, n)
    go3 = grad_out.reshape(pre, R, k).contiguous()
    wT = w.t()
    dx3 = x.new_empty(pre, RP, n)
    dw = torch.empty_like(w)  # w's layout (see the AG ring's backward)
    for t, (src, cur) in enumerate(_ring_pass(group, go3)):
        ring_step_matmul(cur, wT, _rows_block(dx3, src, R), accumulate=False)
        ring_step_matmul(_flat2(_rows_block(x3, src, R)).t(), _flat2(cur), dw, accumulate=t > 0)
    return dx3.view(x.shape), dw


_register_ring_autograd(_ring_matmul_reducescatter, _ring_matmul_reducescatter_backward)


# --------------------------------------------------------------------------- PrimePar P(2^k x 2^k)
#
# Grid: q = 2^k, device (r, c) = group rank r*q + c; all slice indices mod q.
# Matmul: O[M, K] = I[M, N] @ W[N, K]; M = the rows of x (all leading dims
# flattened; the layout helpers split dim -2, the sequence dim, and keep any
# batch dims whole), blocks I_{m,n}, W_{n,kk}, O_{m,kk} of a q x q split.
#
# Layouts (what device (r, c) holds; they are Cannon's skewed alignment):
#   x   = I_{r, r+c}      (M slice r, N slice r+c)
#   w   = W_{r+c, c}      (N slice r+c, K slice c)
#   out = O_{r, c}        (M slice r, K slice c)
#   dx has the layout of x, dw the layout of w.
#
# Schedules (DESIGN.md, "The spatial-temporal primitives"), t = 0..q-1:
#   forward : O_{r,c}       += I_{r, r+c+t} @ W_{r+c+t, c};  I from (r, c+1), W from (r+1, c)
#   backward: dI_{r, r+c-1} += dO_{r, c+t} @ W_{r+c-1, c+t}^T; dO from (r, c+1), W from (r-1, c+1)
#   gradient: M slice r+t, N slice r+c-1+d, K slice c-1+d, d = 1 only at t = q-1:
#       t < q-1: A       += I_{r+t, r+c-1}^T @ dO_{r+t, c-1};  I from (r+1, c-1), dO from (r+1, c)
#       t = q-1: dW_{r+c,c} = I_{r-1, r+c}^T @ dO_{r-1, c} + A received from (r, c+1)
#     The last step's I and dO come from (r+1, c) and (r+1, c+1) instead, and
#     the accumulator A (dW_{r+c-1, c-1} over q-1 of the q M slices) moves one
#     step left to the device that owns that block, overlapping the last matmul.
# Phase boundaries line up with no extra transfer: the forward's last I block
# (I_{r, r+c-1}) is the gradient's first; the forward's last W block
# (W_{r+c-1, c}) is the backward's first; the backward's last dO block
# (dO_{r, c-1}) is the gradient's first. The forward therefore stashes its
# last I and W blocks (returned as extra outputs, saved for backward) instead
# of saving x: the parameter w itself never moves ("W ends where it started").
# Cost of that choice: the W stash is one extra W block alive from forward to
# backward (in PrimePar the W buffer itself rotates, but here w is a parameter
# the optimizer owns). A backward indexed N slice (r+c) instead of (r+c-1)
# would start from the local w and need neither the W stash nor the dI shift
# below; it is not the DESIGN.md schedule, so it is not what runs here.
#
# The one shift: the backward accumulates dI_{r, r+c-1}, which is the x block of
# device (r, c-1), so dI is sent one step left (received from (r, c+1)) while
# the gradient phase computes. dW needs no shift: the accumulator move above
# makes it land on W's owner.
# No collective in any phase, only grid-neighbour P2P, every transfer posted
# before the matmul it hides behind.


def _primepar_grid(group: dist.ProcessGroup, k: int) -> tuple[int, int, int]:
    size = group.size()
    if k < 1 or size != 4 ** k:
        k_fit = round(math.log(size, 4)) if size >= 4 else 0
        fix = (
            f"call it with k={k_fit}"
            if k_fit >= 1 and 4 ** k_fit == size
            else "use a (sub)group of 4, 16, 64, ... ranks (a 2^k x 2^k grid)"
        )
        raise ValueError(
            f"primepar_linear(k={k}) needs a process group of 4**k ranks (a 2^k x 2^k grid); "
            f"this group has {size} ranks: {fix}"
        )
    q = 2 ** k
    rank = group.rank()
    return q, rank // q, rank % q


def primepar_coords(rank: int, k: int) -> tuple[int, int]:
    """Grid coordinates (r, c) of group rank ``rank`` in the 2^k x 2^k grid."""
    q = 2 ** k
    return rank // q, rank % q


def _pp_peer(q: int, r: int, c: int) -> int:
    return (r % q) * q + (c % q)


@torch.library.custom_op("stpc::primepar_linear", mutates_args=())
def _primepar_linear(x: Tensor, w: Tensor, group_name: str, k: int) -> tuple[Tensor, Tensor, Tensor]:
    group = _resolve_process_group(group_name)
    q, r, c = _primepar_grid(group, k)
    nb, kb = w.shape
    if x.shape[-1] != nb:
        raise ValueError(f"primepar_linear: x block {tuple(x.shape)} and w block {tuple(w.shape)} do not line up")
    cur_i = x.reshape(-1, nb).contiguous()
    cur_w = w.contiguous()
    out2 = x.new_empty(cur_i.shape[0], kb)
    (i_to, i_from, _), (w_to, w_from, _) = primepar_peers(group.rank(), k)
    # two receive buffers each, alternating, so neither x nor w is ever overwritten
    i_bufs = [torch.empty_like(cur_i) for _ in range(min(q - 1, 2))]
    w_bufs = [torch.empty_like(cur_w) for _ in range(min(q - 1, 2))]
    for t in range(q):
        works = []
        if t < q - 1:
            i_recv, w_recv = i_bufs[t % 2], w_bufs[t % 2]
            works = _post(
                group,
                sends=[(cur_i, i_to, _TAG_A), (cur_w, w_to, _TAG_B)],
                recvs=[(i_recv, i_from, _TAG_A), (w_recv, w_from, _TAG_B)],
            )
        ring_step_matmul(cur_i, cur_w, out2, accumulate=t > 0)
        _wait(works)
        if t < q - 1:
            cur_i, cur_w = i_recv, w_recv
    # cur_i = I_{r, r+c-1}, cur_w = W_{r+c-1, c}: received buffers (q >= 2), not aliases of x / w
    return out2.view(*x.shape[:-1], kb), cur_i, cur_w


@_primepar_linear.register_fake
def _(x, w, group_name, k):
    rows = math.prod(x.shape[:-1])
    return x.new_empty(*x.shape[:-1], w.shape[1]), x.new_empty(rows, w.shape[0]), w.new_empty(w.shape)


@torch.library.custom_op("stpc::primepar_linear_backward", mutates_args=())
def _primepar_linear_backward(
    grad_out: Tensor, x_stash: Tensor, w_stash: Tensor, group_name: str, k: int
) -> tuple[Tensor, Tensor]:
    """Backward (dI) then gradient (dW) phase of P(2^k x 2^k); returns
    (dx as [rows, N-block], dw as [N-block, K-block]) in the layouts of x and w."""
    group = _resolve_process_group(group_name)
    q, r, c = _primepar_grid(group, k)
    nb, kb = w_stash.shape
    cur_do = grad_out.reshape(-1, kb).contiguous()
    rows = cur_do.shape[0]
    peer = lambda dr, dc: _pp_peer(q, r + dr, c + dc)  # noqa: E731

    # ---- backward phase: dI_{r, r+c-1} += dO_{r, c+t} @ W_{r+c-1, c+t}^T
    di = x_stash.new_empty(rows, nb)
    do_bufs = [torch.empty_like(cur_do) for _ in range(2)]  # 2 even for q = 2: reused below
    w_bufs = [torch.empty_like(w_stash) for _ in range(min(q - 1, 2))]
    cur_w = w_stash
    for t in range(q):
        works = []
        if t < q - 1:
            do_recv, w_recv = do_bufs[t % 2], w_bufs[t % 2]
            works = _post(
                group,
                sends=[(cur_do, peer(0, -1), _TAG_A), (cur_w, peer(1, -1), _TAG_B)],
                recvs=[(do_recv, peer(0, 1), _TAG_A), (w_recv, peer(-1, 1), _TAG_B)],
            )
        ring_step_matmul(cur_do, cur_w.t(), di, accumulate=t > 0)
        _wait(works)
        if t < q - 1:
            cur_do, cur_w = do_recv, w_recv
    del w_bufs, cur_w, w_recv  # (w_recv too: the last one named a buffer the gradient phase would hold)
    # now cur_do = dO_{r, c-1} (a receive buffer), the gradient phase's first dO

    # ---- the dI shift (dI_{r, r+c-1} belongs to (r, c-1)), hidden behind the gradient phase
    dx = x_stash.new_empty(rows, nb)
    shift_works = _post(group, sends=[(di, peer(0, -1), _TAG_C)], recvs=[(dx, peer(0, 1), _TAG_C)])

    # ---- gradient phase
    acc = x_stash.new_empty(nb, kb)
    i_bufs = [torch.empty_like(x_stash) for _ in range(min(q - 1, 2))]
    # Reuse the backward's two dO buffers: the one that is not cur_do is free
    # (its sends were waited); cur_do itself is free once step 0 has sent it,
    # which is before step 1 receives into it.
    do_free = do_bufs[0] if cur_do is do_bufs[1] else do_bufs[1]
    do_bufs = [do_free, cur_do]
    cur_i = x_stash
    acc_works = []
    acc_recv = None
    for t in range(q - 1):
        last_next = t == q - 2  # this step feeds the last (delta = 1) step
        i_recv, do_recv = i_bufs[t % 2], do_bufs[t % 2]
        if last_next:
            i_to, i_from, do_to, do_from = peer(-1, 0), peer(1, 0), peer(-1, -1), peer(1, 1)
        else:
            i_to, i_from, do_to, do_from = peer(-1, 1), peer(1, -1), peer(-1, 0), peer(1, 0)
        works = _post(
            group,
            sends=[(cur_i, i_to, _TAG_A), (cur_do, do_to, _TAG_B)],
            recvs=[(i_recv, i_from, _TAG_A), (do_recv, do_from, _TAG_B)],
        )
        ring_step_matmul(cur_i.t(), cur_do, acc, accumulate=t > 0)
        if last_next:
            # A = dW_{r+c-1, c-1} partial is complete: move it to its owner (r, c-1)
            # while the last step computes; receive the partial of our own block.
            acc_recv = torch.empty_like(acc)
            acc_works = _post(group, sends=[(acc, peer(0, -1), _TAG_D)], recvs=[(acc_recv, peer(0, 1), _TAG_D)])
        _wait(works)
        cur_i, cur_do = i_recv, do_recv
    # last step (delta = 1): dW_{r+c, c} = I_{r-1, r+c}^T @ dO_{r-1, c} + A from (r, c+1)
    dw = x_stash.new_empty(nb, kb)
    ring_step_matmul(cur_i.t(), cur_do, dw, accumulate=False)
    _wait(acc_works)
    dw.add_(acc_recv)
    _wait(shift_works)
    return dx, dw


@_primepar_linear_backward.register_fake
def _(grad_out, x_stash, w_stash, group_name, k):
    return x_stash.new_empty(x_stash.shape), w_stash.new_empty(w_stash.shape)


def _pp_setup_context(ctx, inputs, output):
    x, w, group_name, k = inputs
    _, x_stash, w_stash = output
    # the stashed blocks replace x and w: nothing else from the forward is kept
    ctx.save_for_backward(x_stash, w_stash)
    ctx.mark_non_differentiable(x_stash, w_stash)
    # (their gradients are never read: left undefined, not materialised as zeros, which held
    # a weight block and an input block beside the backward's own buffers at its peak)
    ctx.set_materialize_grads(False)
    ctx.group_name, ctx.k = group_name, k
    ctx.x_shape = x.shape


def _pp_backward(ctx, grad_out, _g_x_stash, _g_w_stash):
    x_stash, w_stash = ctx.saved_tensors
    dx, dw = torch.ops.stpc.primepar_linear_backward(grad_out, x_stash, w_stash, ctx.group_name, ctx.k)
    return dx.view(ctx.x_shape), dw, None, None


_primepar_linear.register_autograd(_pp_backward, setup_context=_pp_setup_context)


# --------------------------------------------------------------------------- layouts for P(2^k x 2^k)


def _blk(t: Tensor, dim: int, idx: int, q: int) -> Tensor:
    size = t.shape[dim]
    if size % q:
        raise ValueError(f"dim {dim} of size {size} does not divide into {q} slices")
    s = size // q
    return t.narrow(dim, (idx % q) * s, s)


def primepar_shard_input(full_x: Tensor, r: int, c: int, k: int) -> Tensor:
    """Device (r, c)'s block of x [..., M, N]: M slice r (dim -2), N slice (r+c) mod 2^k."""
    q = 2 ** k
    return _blk(_blk(full_x, -2, r, q), -1, r + c, q).contiguous()


def primepar_shard_weight(full_w: Tensor, r: int, c: int, k: int) -> Tensor:
    """Device (r, c)'s block of w [N, K]: N slice (r+c) mod 2^k, K slice c."""
    q = 2 ** k
    return _blk(_blk(full_w, 0, r + c, q), 1, c, q).contiguous()


def primepar_shard_output(full_out: Tensor, r: int, c: int, k: int) -> Tensor:
    """Device (r, c)'s block of out [..., M, K]: M slice r (dim -2), K slice c."""
    q = 2 ** k
    return _blk(_blk(full_out, -2, r, q), -1, c, q).contiguous()


def _unshard(blocks: list[Tensor], k: int, row_dim: int, col_dim: int, slot) -> Tensor:
    q = 2 ** k
    if len(blocks) != q * q:
        raise ValueError(f"expected {q * q} blocks (one per rank of the {q}x{q} grid), got {len(blocks)}")
    grid = [[None] * q for _ in range(q)]
    for rank, b in enumerate(blocks):
        r, c = primepar_coords(rank, k)
        i, j = slot(r, c, q)
        grid[i][j] = b
    return torch.cat([torch.cat(row, dim=col_dim) for row in grid], dim=row_dim)


def primepar_unshard_input(blocks: list[Tensor], k: int) -> Tensor:
    """Reassemble x (or dx) [..., M, N] from the per-rank blocks (index = group rank)."""
    return _unshard(blocks, k, -2, -1, lambda r, c, q: (r, (r + c) % q))


def primepar_unshard_weight(blocks: list[Tensor], k: int) -> Tensor:
    """Reassemble w (or dw) [N, K] from the per-rank blocks (index = group rank)."""
    return _unshard(blocks, k, 0, 1, lambda r, c, q: ((r + c) % q, c))


def primepar_unshard_output(blocks: list[Tensor], k: int) -> Tensor:
    """Reassemble out [..., M, K] from the per-rank blocks (index = group rank)."""
    return _unshard(blocks, k, -2, -1, lambda r, c, q: (r, c))


# --------------------------------------------------------------------------- Python wrappers


def ring_allgather_matmul(x: Tensor, w: Tensor, gather_dim: int, group=None) -> Tensor:
    """``all_gather(x, gather_dim) @ w`` as an AG-ring over ``group`` (P ranks).

    x: this rank's shard ``[..., m, ..., N]`` (equal shapes on all ranks;
    shard of group rank j is slice j of the gathered dim); w: ``[N, k]`` (the
    local weight, e.g. a column shard of ``[N, K]``). Returns
    ``[..., P*m, ..., k]``. Gradients: dx has x's layout (reduce-scattered),
    dw is the local weight's gradient. ``group``: ProcessGroup, its name, or
    None for WORLD.
    """
    return torch.ops.stpc.ring_allgather_matmul(x, w, gather_dim, group_name_of(group))


def ring_matmul_reducescatter(x: Tensor, w: Tensor, scatter_dim: int, group=None) -> Tensor:
    """``reduce_scatter(x @ w, scatter_dim)`` as an RS-ring over ``group`` (P ranks).

    x: ``[..., S, ..., n]`` with the contraction dim sharded (n = this rank's
    slice), w: ``[n, K]`` (the matching row shard). Returns this rank's block
    ``[..., S/P, ..., K]`` (slice ``rank`` of ``scatter_dim``) of the sum over
    ranks. Gradients have the layouts of x and w.
    """
    return torch.ops.stpc.ring_matmul_reducescatter(x, w, scatter_dim, group_name_of(group))


def primepar_linear(x: Tensor, w: Tensor, group=None, k: int = 1) -> Tensor:
    """PrimePar P(2^k x 2^k) linear ``out = x @ w`` over a group of 4**k ranks.

    Device (r, c) = group rank r*2^k + c holds (see the layout helpers)
      x:   ``[..., M/q, N/q]`` = M slice r (dim -2), N slice (r+c) mod q
      w:   ``[N/q, K/q]``     = N slice (r+c) mod q, K slice c
      out: ``[..., M/q, K/q]`` = M slice r, K slice c
    with q = 2^k; dx and dw come back in the layouts of x and w. No
    collective in forward, backward or gradient; only grid-neighbour P2P.
    Raises ValueError if the group does not have 4**k ranks.
    """
    out, _, _ = torch.ops.stpc.primepar_linear(x, w, group_name_of(group), k)
    return out
