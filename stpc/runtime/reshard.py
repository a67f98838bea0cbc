"""reshard: the autograd-aware resharding functions the rewritten graph calls.

Every function here is a plain differentiable distributed function of local
tensors; it knows nothing of plans or graphs. A process group is named by its
``group_name`` string (as ``torch.distributed._functional_collectives`` and
the ring ops of :mod:`stpc.runtime.ops.ring` take it), so graph nodes stay picklable
and identical on every rank; the rank's coordinate on the group is read at run
time. Forward collectives are the functional collectives (``_c10d_functional``).

Gradient conventions (what makes replicated parameters' gradients complete
and identical on every rank): the gradient of a Shard tensor is a Shard of the
gradient; of a Partial tensor, the complete gradient, replicated; of a
Replicate tensor, the complete gradient, replicated — every edge whose
consumer splits its work on an axis but reads a Replicate operand turns the
partial gradient it produces back into a complete one (``grad`` argument
below, Megatron's "f"). Per mesh axis:

  function           forward                      backward
  all_gather         S(d) -> R: all-gather        grad="rs": reduce-scatter (partial
                                                  grad), grad="slice": local slice
  all_reduce         P -> R: all-reduce           grad="identity" | "all_reduce"
  reduce_scatter     P -> S(d): reduce-scatter    all-gather
  all_to_all         S(a) -> S(b)                 all_to_all S(b) -> S(a)
  shard_slice        R -> S(d): local slice       all-gather (complete grad)
  to_partial         R -> P: x / n                identity
  grad_all_reduce    R -> R: identity             all-reduce (Megatron's f)
  grid_gather        B/X/W -> R: all-gather +     grad="rs" | "slice", in the layout
                     reassemble
  grid_slice         R -> B/X/W: local block      all-gather (complete grad)
  grid_skew          B -> X (P2P, PrimePar)       X -> B (P2P)
  grid_relayout      one grid layout to another   the reverse permutation (P2P)
                     (a permutation, P2P)
  redistribute       a split layout (S or grid)   the reverse exchange
                     to another: all-to-all of
                     the slices' overlaps

Plus the local rewrites of split ops (:func:`vocab_parallel_embedding`,
:func:`cross_entropy_count`), the
spatial reference of a P(2^k x 2^k) linear (:func:`grid_linear`, what
``insert_collectives`` emits and ``ring_decompose`` replaces by the step
schedule), the tensor-level helpers :func:`shard_tensor` /
:func:`unshard_tensor` and per-axis groups of a ``DeviceMesh`` (:func:`axis_groups`).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from stpc.placement import grid_index, parse
from stpc.runtime.failure import comm_failure
from stpc.runtime.lazy_wait import read_later

__all__ = [
    "all_gather", "all_reduce", "all_reduce_start", "wait", "reduce_scatter", "all_to_all", "shard_slice",
    "to_partial",
    "grad_all_reduce", "grid_gather", "grid_slice", "grid_skew", "grid_relayout", "grid_linear", "redistribute",
    "vocab_parallel_embedding", "cross_entropy_count", "shard_tensor", "unshard_tensor", "axis_groups", "joint_group", "resolve_group", "mesh_coords", "skew_peers",
    "relayout_peers",
    "COMM_FUNCTIONS",
]


# --------------------------------------------------------------------------- groups


@lru_cache(maxsize=None)
def _pg(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group named ``group_name`` (as graph nodes and ring ops name groups)."""
    return _pg(group_name)


# group name -> (size, this rank's index in it). A plain dict that torch.compile reads (and
# guards on) where resolving the process group, a C++ call, would break the graph.
_GROUP_INFO: dict[str, tuple[int, int]] = {}


def _info(group_name: str) -> tuple[int, int]:
    got = _GROUP_INFO.get(group_name)
    if got is None:
        pg = _pg(group_name)
        got = _GROUP_INFO[group_name] = (pg.size(), pg.rank())
    return got


def _size(group_name: str) -> int:
    return _info(group_name)[0]


def _rank(group_name: str) -> int:
    return _info(group_name)[1]


def axis_groups(mesh) -> list[str]:
    """Group name of every axis of a ``DeviceMesh`` (row-major, last axis innermost)."""
    names = [mesh.get_group(a).group_name for a in range(mesh.ndim)]
    for name in names:
        _info(name)  # known before any program that names the group is compiled
    return names


_JOINT: dict[tuple, str] = {}


def joint_group(mesh, axes: tuple[int, ...], timeout=None) -> str:
    """Name of the group over mesh axes ``axes`` taken together (this rank's: the ranks that
    differ from it on those axes only), e.g. both axes of a 2-D data-parallel mesh, so one
    collective sums over all of them. One axis: that axis's group. Collective on a new set
    of axes: every rank calls it with the same axes in the same order."""
    axes = tuple(sorted(axes))
    if len(axes) == 1:
        return mesh.get_group(axes[0]).group_name
    key = (id(dist.distributed_c10d._get_default_group()), tuple(mesh.mesh.flatten().tolist()),
           tuple(mesh.mesh.shape), axes)
    if key not in _JOINT:
        ranks = mesh.mesh.permute(*[a for a in range(mesh.ndim) if a not in axes], *axes)
        ranks = ranks.reshape(-1, math.prod(int(mesh.mesh.shape[a]) for a in axes)).tolist()
        group, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
        _JOINT[key] = group.group_name
        _info(_JOINT[key])
    return _JOINT[key]


def mesh_coords(rank: int, mesh_shape) -> tuple[int, ...]:
    """Coordinates of global ``rank`` in a row-major mesh of ``mesh_shape``."""
    out = []
    for n in reversed(tuple(mesh_shape)):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


_c10d = torch.ops._c10d_functional


def _guarded(what: str, fn, group: str, *args):
    """``fn(*args)``, its backend failures raised as a :class:`CommFailure` naming ``what``.
    Under torch.compile the call is traced as it is (the compiled program's caller reports)."""
    if torch.compiler.is_compiling():
        return fn(*args)
    try:
        return fn(*args)
    except RuntimeError as e:
        raise comm_failure(what, group, e) from e


def _release(buf: Tensor) -> None:
    """Free a finished collective's input buffer now. Its last reference may otherwise die on
    the backend's worker thread, which lets a finished work's tensors go only when it next
    runs (gloo: on two shared cores, past the next allocations of this thread; the fidelity
    bench measured 16 MiB more in one step of four). The collective has been waited on, so
    nothing reads it again; on CUDA the caching allocator still orders its reuse after the
    streams it was recorded on. Under torch.compile inductor plans the buffers itself."""
    if not torch.compiler.is_compiling():
        buf.untyped_storage().resize_(0)


def _ag_impl(x: Tensor, dim: int, group: str) -> Tensor:
    n = _size(group)
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), n, group))
    if dim != 0:
        out = torch.cat(out.chunk(n, dim=0), dim=dim)
    return out


def _ag(x: Tensor, dim: int, group: str) -> Tensor:
    """all-gather along ``dim`` (the functional collective gathers along dim 0)."""
    return _guarded("all_gather", _ag_impl, group, x, dim, group)


def _rs_impl(x: Tensor, dim: int, group: str) -> Tensor:
    n = _size(group)
    if dim != 0:
        x = torch.cat(x.chunk(n, dim=dim), dim=0)
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x.contiguous(), "sum", n, group))


def _rs(x: Tensor, dim: int, group: str) -> Tensor:
    """reduce-scatter (sum) along ``dim``."""
    return _guarded("reduce_scatter", _rs_impl, group, x, dim, group)


def _ar_impl(x: Tensor, group: str) -> Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))


def _ar(x: Tensor, group: str) -> Tensor:
    return _guarded("all_reduce", _ar_impl, group, x, group)


def _piece(shape, dim: int, n: int) -> int:
    """The size of one of ``n`` equal pieces of dim ``dim``; an uneven split is an error,
    never a floor division that silently drops the remainder."""
    if shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of a tensor of shape {tuple(shape)} into {n} equal "
                         f"pieces ({shape[dim]} is not a multiple of {n})")
    return shape[dim] // n


def _chunk(x: Tensor, dim: int, n: int, i: int) -> Tensor:
    """Piece ``i`` of ``n`` equal pieces of ``x`` along ``dim`` (a view)."""
    s = _piece(x.shape, dim, n)
    return x.narrow(dim, i * s, s)


def _own(piece: Tensor) -> Tensor:
    """A slice as a compact tensor of its own. ``.contiguous()`` is not enough: a slice along
    the outermost dim is already contiguous, so it would stay a view, and wherever it is saved
    for backward (attention saves q, k, v) it keeps the whole gathered tensor alive, n times
    the slice the plan (and the memory model) holds."""
    return piece.clone(memory_format=torch.contiguous_format)


def _a2a_impl(x: Tensor, src_dim: int, dst_dim: int, group: str) -> Tensor:
    n = _size(group)
    parts = torch.stack(list(x.chunk(n, dim=dst_dim)), 0).contiguous()
    shape = parts.shape
    flat = parts.reshape(-1)
    del parts
    split = [flat.numel() // n] * n
    got = _c10d.wait_tensor(_c10d.all_to_all_single(flat, split, split, group))
    # the send buffer is done with once the exchange is: free it before the output is
    # assembled, so the working set is x, the received blocks and the output, never four
    _release(flat)
    return torch.cat(list(got.view(shape).unbind(0)), dim=src_dim)


def _a2a(x: Tensor, src_dim: int, dst_dim: int, group: str) -> Tensor:
    """S(src_dim) -> S(dst_dim): split ``dst_dim`` into n pieces, exchange, concatenate on ``src_dim``."""
    return _guarded("all_to_all", _a2a_impl, group, x, src_dim, dst_dim, group)


# --------------------------------------------------------------------------- per-axis reshards


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, grad):
        ctx.dim, ctx.group, ctx.grad = dim, group, grad
        return _ag(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad == "rs":
            return _rs(g, ctx.dim, ctx.group), None, None, None
        return _own(_chunk(g, ctx.dim, _size(ctx.group), _rank(ctx.group))), None, None, None


def all_gather(x: Tensor, dim: int, group: str, grad: str = "rs") -> Tensor:
    """S(dim) -> R over ``group``. ``grad="rs"``: the consumer splits its work on this
    axis, so the incoming gradient is partial (reduce-scatter it); ``"slice"``: it is
    complete (take this rank's slice)."""
    return _AllGather.apply(x, dim, group, grad)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad):
        ctx.group, ctx.grad = group, grad
        return _ar(x, group)

    @staticmethod
    def backward(ctx, g):
        return (_ar(g, ctx.group) if ctx.grad == "all_reduce" else g), None, None


def all_reduce(x: Tensor, group: str, grad: str = "identity") -> Tensor:
    """P -> R (sum). ``grad="all_reduce"`` when the consumer splits its work on this axis."""
    return _AllReduce.apply(x, group, grad)


class _AllReduceStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _guarded("all_reduce", _c10d.all_reduce, group, x.contiguous(), "sum", group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        out = _c10d.wait_tensor(t)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return g


def all_reduce_start(x: Tensor, group: str) -> Tensor:
    """:func:`all_reduce` (``grad="identity"``) issued and not waited on: the result is only
    valid after :func:`wait`. For a forward collective issued long before its use."""
    return _AllReduceStart.apply(x, group)


def wait(t: Tensor) -> Tensor:
    """``t`` (of a collective issued earlier), once its communication has finished."""
    return _Wait.apply(t)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _rs(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _ag(g, ctx.dim, ctx.group), None, None


def reduce_scatter(x: Tensor, dim: int, group: str) -> Tensor:
    """P -> S(dim): sum over the group, keep this rank's slice; backward all-gathers."""
    return _ReduceScatter.apply(x, dim, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, group):
        ctx.src_dim, ctx.dst_dim, ctx.group = src_dim, dst_dim, group
        return _a2a(x, src_dim, dst_dim, group)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g, ctx.dst_dim, ctx.src_dim, ctx.group), None, None, None


def all_to_all(x: Tensor, src_dim: int, dst_dim: int, group: str) -> Tensor:
    """S(src_dim) -> S(dst_dim) over ``group``; backward is the reverse exchange."""
    return _AllToAll.apply(x, src_dim, dst_dim, group)


class _ShardSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _own(_chunk(x, dim, _size(group), _rank(group)))

    @staticmethod
    def backward(ctx, g):
        # the producer is Replicate: its gradient must be complete on every rank
        return _ag(g, ctx.dim, ctx.group), None, None


def shard_slice(x: Tensor, dim: int, group: str) -> Tensor:
    """R -> S(dim): this rank's slice; backward all-gathers the complete gradient."""
    return _ShardSlice.apply(x, dim, group)


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n):
        return x / n

    @staticmethod
    def backward(ctx, g):
        # the gradient of a Partial tensor is complete: it is the gradient of x
        return g, None


def to_partial(x: Tensor, group: str) -> Tensor:
    """R -> P: every rank holds x / n (their sum is x); backward is the identity."""
    return _ToPartial.apply(x, _size(group))


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, wait):
        ctx.group, ctx.wait = group, wait
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.wait == "on_read" and not torch.compiler.is_compiling():
            return read_later(_guarded("all_reduce", _c10d.all_reduce, ctx.group, g.contiguous(), "sum",
                                       ctx.group)), None, None
        return _ar(g, ctx.group), None, None


def grad_all_reduce(x: Tensor, group: str, wait: str = "now") -> Tensor:
    """Megatron's "f": identity forward; backward all-reduces the partial gradient that a
    consumer splitting its work on this axis produces for a Replicate operand.

    ``wait="on_read"``: backward issues the all-reduce and hands its result on unwaited
    (:func:`stpc.runtime.lazy_wait.read_later`): the first op that reads it waits. For a
    parameter's gradient (``passes.defer_grad_sync`` marks those it cannot defer), which
    is read where autograd sums the parameter's gradients, at its last use in backward.
    Under ``torch.compile`` it is waited in place (inductor places the wait)."""
    if wait not in ("now", "on_read"):
        raise ValueError(f"grad_all_reduce: wait={wait!r}; give 'now' or 'on_read'")
    return _GradAllReduce.apply(x, group, wait)


# --------------------------------------------------------------------------- PrimePar grid layouts


def _grid_block(x: Tensor, kind: str, i: int, j: int, rank: int, n: int) -> Tensor:
    q = math.isqrt(n)
    bi, bj = grid_index(kind, rank // q, rank % q, q)
    return _chunk(_chunk(x, i, q, bi), j, q, bj)


def _grid_assemble(stacked: Tensor, kind: str, i: int, j: int) -> Tensor:
    """The whole tensor from ``stacked`` [n, *block] (every rank's block, by group rank), each
    block copied straight into its place: one output allocation beside the gathered buffer
    (concatenating rows first and then the rows would hold a third full-size copy)."""
    n = stacked.shape[0]
    q = math.isqrt(n)
    shape = list(stacked.shape[1:])
    shape[i] *= q
    shape[j] *= q
    out = stacked.new_empty(shape)
    for rank in range(n):
        _grid_block(out, kind, i, j, rank, n).copy_(stacked[rank])
    return out


def _grid_blocks_of(full: Tensor, kind: str, i: int, j: int, n: int) -> Tensor:
    """[n, *block]: the block every rank holds, stacked by group rank."""
    return torch.stack([_grid_block(full, kind, i, j, rk, n) for rk in range(n)], 0)


class _GridGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, i, j, group, grad):
        ctx.args = (kind, i, j, group, grad)
        stacked = _ag(x.unsqueeze(0), 0, group)
        return _grid_assemble(stacked, kind, i, j)

    @staticmethod
    def backward(ctx, g):
        kind, i, j, group, grad = ctx.args
        n = _size(group)
        if grad == "rs":
            blocks = _grid_blocks_of(g, kind, i, j, n)
            dx = _rs(blocks, 0, group).squeeze(0)
        else:
            dx = _own(_grid_block(g, kind, i, j, _rank(group), n))
        return dx, None, None, None, None, None


def grid_gather(x: Tensor, kind: str, i: int, j: int, group: str, grad: str = "rs") -> Tensor:
    """A PrimePar grid layout (``kind`` in B, X, W over dims i, j) -> R."""
    return _GridGather.apply(x, kind, i, j, group, grad)


class _GridSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, i, j, group):
        ctx.args = (kind, i, j, group)
        return _own(_grid_block(x, kind, i, j, _rank(group), _size(group)))

    @staticmethod
    def backward(ctx, g):
        kind, i, j, group = ctx.args
        stacked = _ag(g.unsqueeze(0), 0, group)
        return _grid_assemble(stacked, kind, i, j), None, None, None, None


def grid_slice(x: Tensor, kind: str, i: int, j: int, group: str) -> Tensor:
    """R -> a PrimePar grid layout: this rank's block; backward gathers the complete gradient."""
    return _GridSlice.apply(x, kind, i, j, group)


def skew_peers(rank: int, n: int, inverse: bool = False) -> tuple[int, int]:
    """(send-to, receive-from) group ranks of the B -> X skew (X -> B if ``inverse``).

    Device (r, c) holds B block (r, c) and needs X block (r, r+c): block (r, c) moves
    along its grid row from (r, c) to (r, c-r). The inverse moves it back.
    """
    q = math.isqrt(n)
    r, c = divmod(rank, q)
    to, frm = r * q + (c - r) % q, r * q + (c + r) % q
    return (frm, to) if inverse else (to, frm)


# A custom op, as the ring ops are: torch.compile treats it as one opaque call (dynamo cannot
# trace ``batch_isend_irecv``, which broke the graph at every grid skew and relayout).
@torch.library.custom_op("stpc::p2p_exchange", mutates_args=())
def _p2p_impl(x: Tensor, group: str, send_to: int, recv_from: int) -> Tensor:
    pg = _pg(group)
    x = x.contiguous()
    if send_to == pg.rank() and recv_from == pg.rank():
        return x.clone()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, group=pg, group_peer=send_to),
           dist.P2POp(dist.irecv, out, group=pg, group_peer=recv_from)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


@_p2p_impl.register_fake
def _(x, group, send_to, recv_from):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _p2p_exchange(x: Tensor, group: str, send_to: int, recv_from: int) -> Tensor:
    return _guarded(f"P2P exchange (send to {send_to}, receive from {recv_from})", _p2p_impl, group, x, group,
                    send_to, recv_from)


class _GridSkew(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inverse):
        ctx.group, ctx.inverse = group, inverse
        to, frm = skew_peers(_rank(group), _size(group), inverse)
        return _p2p_exchange(x, group, to, frm)

    @staticmethod
    def backward(ctx, g):
        to, frm = skew_peers(_rank(ctx.group), _size(ctx.group), not ctx.inverse)
        return _p2p_exchange(g, ctx.group, to, frm), None, None


def grid_skew(x: Tensor, group: str, inverse: bool = False) -> Tensor:
    """B(i,j) -> X(i,j) on a 2^k x 2^k grid by one P2P exchange along grid rows
    (``inverse``: X -> B). Backward is the opposite exchange."""
    return _GridSkew.apply(x, group, inverse)


def relayout_peers(rank: int, n: int, src: str, dst: str) -> tuple[int, int]:
    """(send-to, receive-from) group ranks that turn grid layout ``src`` into ``dst`` (kinds
    B, X, W): every device holds one block under either, so the change is a permutation —
    this rank's ``src`` block goes to the device that holds it under ``dst``."""
    q = math.isqrt(n)
    holder = {grid_index(src, k // q, k % q, q): k for k in range(n)}
    wants = {grid_index(dst, k // q, k % q, q): k for k in range(n)}
    r, c = divmod(rank, q)
    return wants[grid_index(src, r, c, q)], holder[grid_index(dst, r, c, q)]


class _GridRelayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group):
        ctx.args = (src, dst, group)
        to, frm = relayout_peers(_rank(group), _size(group), src, dst)
        return _p2p_exchange(x, group, to, frm)

    @staticmethod
    def backward(ctx, g):
        src, dst, group = ctx.args
        to, frm = relayout_peers(_rank(group), _size(group), dst, src)
        return _p2p_exchange(g, group, to, frm), None, None, None


def grid_relayout(x: Tensor, src: str, dst: str, group: str) -> Tensor:
    """One grid layout to another over the same dims (``src``/``dst`` kinds among B, X, W)
    by one P2P exchange; backward is the reverse exchange. (B -> X is :func:`grid_skew`.)"""
    return _GridRelayout.apply(x, src, dst, group)


# --------------------------------------------------------------------------- slice overlap


def _held_box(tok: str, k: int, n: int, full: list[int]) -> list[tuple[int, int]]:
    """(start, length) per dim of the block group rank ``k`` holds under the split token
    ``tok`` (S(d), or a grid kind over (i, j)) of a tensor of shape ``full`` on this axis."""
    kind, dims = parse(tok)
    box = [(0, s) for s in full]
    if kind == "S":
        pieces = {dims[0]: (k, n)}
    else:
        q = math.isqrt(n)
        bi, bj = grid_index(kind, k // q, k % q, q)
        pieces = {dims[0]: (bi, q), dims[1]: (bj, q)}
    for d, (idx, parts) in pieces.items():
        size = _piece(full, d, parts)
        box[d] = (idx * size, size)
    return box


def _whole_shape(local: torch.Size, tok: str, n: int) -> list[int]:
    kind, dims = parse(tok)
    full = list(local)
    for d in dims:
        full[d] *= n if kind == "S" else math.isqrt(n)
    return full


def _overlap(a, b):
    """The box both boxes cover, or None."""
    box = [(max(s, t), min(s + m, t + l) - max(s, t)) for (s, m), (t, l) in zip(a, b)]
    return None if any(length <= 0 for _, length in box) else box


def _numel(box) -> int:
    """Elements in ``box`` (0 for no box)."""
    return math.prod(length for _, length in box) if box is not None else 0


def _within(box, origin) -> tuple:
    """Index of ``box`` inside a tensor that holds the box ``origin``."""
    return tuple(slice(s - o, s - o + length) for (s, length), (o, _) in zip(box, origin))


def _layout_box(toks: tuple, k: int, sizes: tuple, full: list[int]) -> list[tuple[int, int]]:
    """(start, length) per dim of the block group rank ``k`` holds under ``toks``, one split
    token per axis of a group over several mesh axes of ``sizes`` (its ranks row-major over
    them, as ``joint_group`` orders them): the splits nest outer axis first (each cuts the
    block the axes before it left), as the runtime lays out every placement."""
    box = [(0, s) for s in full]
    for tok, c, n in zip(toks, mesh_coords(k, sizes), sizes):
        sub = _held_box(tok, c, n, [length for _, length in box])
        box = [(s + t, length) for (s, _), (t, length) in zip(box, sub)]
    return box


def _layout_whole_shape(local: torch.Size, toks: tuple, sizes: tuple) -> list[int]:
    full = list(local)
    for tok, n in zip(toks, sizes):
        full = _whole_shape(full, tok, n)
    return full


def _redistribute_impl(x: Tensor, src: tuple, dst: tuple, group: str, sizes: tuple) -> Tensor:
    n, me = _size(group), _rank(group)
    full = _layout_whole_shape(x.shape, src, sizes)
    held, wanted = _layout_box(src, me, sizes, full), _layout_box(dst, me, sizes, full)
    send_boxes = [_overlap(held, _layout_box(dst, peer, sizes, full)) for peer in range(n)]  # mine, that peer wants
    recv_boxes = [_overlap(_layout_box(src, peer, sizes, full), wanted) for peer in range(n)]  # that peer's, I want
    send_sizes, recv_sizes = [_numel(box) for box in send_boxes], [_numel(box) for box in recv_boxes]
    # the pieces are written straight into the send buffer (no per-peer copies beside it),
    # and it is freed once the exchange is done, before the output is allocated: the working
    # set is x, one buffer and the received blocks, then x, those blocks and the output
    flat = x.new_empty(sum(send_sizes))
    offset = 0
    for box, k in zip(send_boxes, send_sizes):
        if box is not None:
            flat[offset:offset + k].view([length for _, length in box]).copy_(x[_within(box, held)])
            offset += k
    got = _c10d.wait_tensor(_c10d.all_to_all_single(flat, recv_sizes, send_sizes, group))
    _release(flat)
    y = x.new_empty([length for _, length in wanted])
    offset = 0
    for box, k in zip(recv_boxes, recv_sizes):
        if box is not None:
            y[_within(box, wanted)].copy_(got[offset:offset + k].view([length for _, length in box]))
            offset += k
    return y


def _redistribute(x: Tensor, src: tuple, dst: tuple, group: str, sizes: tuple) -> Tensor:
    what = " ".join(src) + " -> " + " ".join(dst)
    return _guarded(f"all_to_all (redistribute {what})", _redistribute_impl, group, x, src, dst, group, sizes)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group, sizes):
        ctx.args = (src, dst, group, sizes)
        return _redistribute(x, src, dst, group, sizes)

    @staticmethod
    def backward(ctx, g):
        src, dst, group, sizes = ctx.args
        return _redistribute(g, dst, src, group, sizes), None, None, None, None


def redistribute(x: Tensor, src, dst, group: str, sizes: tuple | None = None) -> Tensor:
    """One split layout to another, by slice overlap: each rank sends every other rank
    exactly the part of its block that rank holds under ``dst`` (one all-to-all with
    per-peer sizes, zero where two blocks do not meet), never the whole tensor. Backward
    is the reverse exchange: each element lives on one rank under either layout, so its
    gradient does too.

    On one axis ``src``/``dst`` are tokens (S(d) or a PrimePar grid token). Over a group of
    several mesh axes (``joint_group``; ``sizes``: theirs, in order) they are tuples of split
    tokens, one per axis, nested outer axis first: a dim split over two axes whose outer
    split changes (tokens S1, S0 -> S0, S0: the rows re-cut four ways across both axes)
    moves only each block's overlaps over the joint group, where the axes taken one by one
    would gather the inner axis whole and split it again (``insert_collectives.reshard_steps``)."""
    if isinstance(src, str):
        src, dst, sizes = (src,), (dst,), (_size(group),)
    src, dst, sizes = tuple(src), tuple(dst), tuple(int(n) for n in sizes)
    if not (len(src) == len(dst) == len(sizes)) or math.prod(sizes) != _size(group):
        raise ValueError(f"redistribute {src} -> {dst} over axes of sizes {sizes}: the group has "
                         f"{_size(group)} ranks and the layouts need one token per axis")
    return _Redistribute.apply(x, src, dst, group, sizes)


def grid_linear(x: Tensor, w: Tensor, group: str, rows: int = -2) -> Tensor:
    """Spatial reference of a P(2^k x 2^k) linear ``x @ w.T``: x in X(m, last), the torch
    weight [K, N] in W(0, 1); returns this rank's B(m, last) block. ``rows``: m, the dim the
    grid's rows split (the sequence, -2, or a [batch, seq, hidden] activation's batch, 0).

    It gathers x's grid row and w's grid column with collectives: correct, but it moves
    far more than the step schedule. ``ring_decompose`` replaces it by
    :func:`stpc.runtime.ops.ring.primepar_linear`.
    """
    n = _size(group)
    q = math.isqrt(n)
    r, c = divmod(_rank(group), q)
    m = rows % x.dim()
    xf = grid_gather(x, "X", m, x.dim() - 1, group, grad="rs")
    wf = grid_gather(w, "W", 0, 1, group, grad="rs")
    return torch.nn.functional.linear(_chunk(xf, m, q, r), _chunk(wf, 0, q, c))


# --------------------------------------------------------------------------- local rewrites of split ops


def vocab_parallel_embedding(weight: Tensor, idx: Tensor, groups: list[str], vocab: int) -> Tensor:
    """Embedding with the vocabulary (weight dim 0) split over ``groups`` (outer axis first):
    a masked local lookup; the sum over those ranks is the full lookup (Partial)."""
    chunk, n = 0, 1
    for g in groups:
        chunk = chunk * _size(g) + _rank(g)
        n *= _size(g)
    rows = vocab // n
    lo = chunk * rows
    local = idx - lo
    outside = (local < 0) | (local >= rows)
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def cross_entropy_count(target: Tensor, ignore_index: int, weight: Tensor | None = None,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """How many of this rank's targets a mean cross-entropy counts (not ``ignore_index``;
    with class weights, their weights' sum). Summed over the ranks that split the rows, it
    is the global mean's denominator: each rank's summed loss divided by it adds up to the
    global mean however the ignored targets fall (a mean of local means would not).
    Carries no gradient."""
    with torch.no_grad():
        keep = target != ignore_index
        if weight is None:
            return keep.sum().to(dtype)
        return (weight[target.masked_fill(~keep, 0)] * keep).sum().to(dtype)


# the functions whose nodes are communication (verify, dumps and tests key on them)
COMM_FUNCTIONS = {all_gather, all_reduce, all_reduce_start, reduce_scatter, all_to_all, grad_all_reduce,
                  grid_gather, grid_slice, grid_skew, grid_relayout, grid_linear, shard_slice, redistribute}


# --------------------------------------------------------------------------- whole tensors


def shard_tensor(full: Tensor, placement, mesh_shape, coords) -> Tensor:
    """This rank's local piece of ``full`` under ``placement`` (one token per axis; nested
    splits outer axis first), for mesh coordinates ``coords``. P keeps x / n."""
    x = full
    for tok, n, i in zip(placement, mesh_shape, coords):
        kind, dims = parse(tok)
        if kind == "S":
            x = _chunk(x, dims[0], n, i)
        elif kind in "BXW":
            x = _grid_block(x, kind, dims[0], dims[1], i, n)
        elif kind == "P":
            x = x / n
    return x.contiguous()


def unshard_tensor(local: Tensor, placement, groups: list[str]) -> Tensor:
    """The full tensor from every rank's ``local`` piece (a collective: every rank of
    every axis group calls it). No autograd."""
    x = local.detach()
    for a in reversed(range(len(placement))):
        kind, dims = parse(placement[a])
        if kind == "S":
            x = _ag(x, dims[0], groups[a])
        elif kind in "BXW":
            stacked = _ag(x.unsqueeze(0), 0, groups[a])
            x = _grid_assemble(stacked, kind, dims[0], dims[1])
        elif kind == "P":
            x = _ar(x, groups[a])
    return x
