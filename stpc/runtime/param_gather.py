"""param_gather: the shards of several parameters gathered whole in one collective, issued
early and waited late (FSDP's coalesced, prefetched all-gather).

    out = gather_start(shards, group)                      # one all-gather, not waited on
    full = gather_wait(out, shapes, dims, group)           # waits; each parameter whole

``gather_start`` flattens this rank's shards into one buffer and issues one
``all_gather_into_tensor`` over ``group`` (a functional collective: it returns at once,
the data arrives while the caller computes); ``gather_wait`` waits for it and cuts each
parameter out of the rank-major buffer, joining the ranks' pieces along the dim it is
split on. Backward is the dual: ``gather_wait`` lays the gradients of the whole
parameters back out rank-major and (``grad="rs"``: the consumers split their work over
the group, so each rank holds a partial gradient) launches their one reduce-scatter at
once, so it travels while backward computes the earlier layers; ``gather_start``, which
the autograd engine runs after those (it was made earlier in forward), waits for it and
cuts it into the shards' gradients (``grad="slice"``: the gradient is complete, this
rank keeps its part). Under ``torch.compile`` the reduce-scatter is issued and waited in
``gather_start``'s backward (the compiler schedules it).

Inside :class:`RegatherSaved` (the compiled model runs its eager programs in one), the
whole parameters are not kept from forward to backward, as FSDP2 does by default
(``reshard_after_forward``): what autograd saves of them is replaced by a note of where
it lies, and backward gathers the layer again when it first needs it, issuing the
previous layer's gather at the same time (backward prefetch). The exception is a gather
made with ``keep=True`` (``passes.prefetch_params`` marks the head's, after the last
layer, whose backward runs first): its whole parameters are kept for backward, as FSDP2
keeps its root module's (gathered again, they would come back the moment forward freed
them, their buffer in flight beside the loss's gradient and the prefetched layer's). A
layer's whole parameters live while it computes, forward or backward, plus the next
one's in flight.

Plain differentiable distributed functions of local tensors; they know nothing of plans.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from stpc.runtime.reshard import _c10d, _guarded, _rank, _size

__all__ = ["gather_start", "gather_wait", "RegatherSaved"]

_ACTIVE: list = []  # the RegatherSaved contexts entered, innermost last


def _start(flat: Tensor, n: int, group: str) -> Tensor:
    return _c10d.all_gather_into_tensor(flat, n, group)


def _reduce_scatter(flat: Tensor, n: int, group: str) -> Tensor:
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", n, group))


class _GatherStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, grad, *shards):
        ctx.group, ctx.grad = group, grad
        ctx.shapes = [s.shape for s in shards]
        if not torch.compiler.is_compiling():  # eager only (RegatherSaved): the tracer needs no tensors on ctx
            ctx.shards = shards  # the parameters' own local tensors (no copy): what a re-gather reads
        flat = torch.cat([s.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0].reshape(-1).contiguous()
        return _guarded("all_gather (coalesced parameters)", _start, group, flat, _size(group), group)

    @staticmethod
    def backward(ctx, g):
        n = _size(ctx.group)
        pending = getattr(ctx, "pending", None)
        if pending is not None:  # launched by gather_wait's backward: only wait for it here
            ctx.pending = None
            mine = _guarded("reduce_scatter (coalesced parameter gradients)", _c10d.wait_tensor, ctx.group, pending)
        elif ctx.grad == "rs":
            mine = _guarded("reduce_scatter (coalesced parameter gradients)", _reduce_scatter, ctx.group,
                            g.contiguous(), n, ctx.group)
        else:  # this rank's part, copied out: a view would keep the whole gathered gradient alive
            mine = g.reshape(n, -1)[_rank(ctx.group)].clone()
        grads, offset = [], 0
        for shape in ctx.shapes:
            k = math.prod(shape)
            grads.append(mine[offset:offset + k].view(shape))
            offset += k
        return (None, None, *grads)


class _GatherWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, shapes, dims, group, keep):
        n = _size(group)
        ctx.shapes, ctx.dims, ctx.n, ctx.like = shapes, dims, n, (out.dtype, out.device)
        # eager: this gather's start node, so backward can launch its reduce-scatter early (a
        # traced program never reads grad_fn: the compiler schedules the reduce-scatter)
        ctx.group, ctx.start = group, None
        buf = _c10d.wait_tensor(out).view(n, -1)
        fulls = _cut(buf, shapes, dims, n)
        if not torch.compiler.is_compiling():
            start = out.grad_fn
            if isinstance(start, _GatherStart._backward_cls):
                ctx.start = start if start.grad == "rs" else None
                if _ACTIVE:
                    _ACTIVE[-1].note(start.shards, group, shapes, dims, [buf, *fulls], keep)
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        flat = _rank_major(grads, ctx.shapes, ctx.dims, n, *ctx.like)
        start, ctx.start = ctx.start, None
        if start is None:
            return flat, None, None, None, None
        # launch the layer's reduce-scatter now: it travels while backward computes the earlier
        # layers, and the start node (run later by the engine) waits for it; autograd gets a
        # stand-in of the right shape (no memory), which the start node ignores
        start.pending = _guarded("reduce_scatter (coalesced parameter gradients)", _c10d.reduce_scatter_tensor,
                                 ctx.group, flat, "sum", n, ctx.group)
        return torch.zeros((), dtype=flat.dtype, device=flat.device).expand(flat.shape), None, None, None, None


def _rank_major(grads, shapes, dims, n: int, dtype, device) -> Tensor:
    """The whole gradients ``grads`` (None: no gradient, zeros) laid out as the gathered buffer
    was, rank-major ([rank, flat shards], flattened): what the reduce-scatter reads. Each is
    copied once, straight into its place (a per-gradient reshape to rank-major and then a
    concatenation made two whole copies: 16 MiB more than FSDP2 at the runtime bench's
    backward peak)."""
    buf = torch.empty(n, sum(math.prod(shape) for shape in shapes), dtype=dtype, device=device)
    offset = 0
    for g, shape, d in zip(grads, shapes, dims):
        k = math.prod(shape)
        place = buf[:, offset:offset + k].view(n, *shape)  # [rank, *shard]
        offset += k
        if g is None:  # a parameter no consumer differentiates: no gradient to reduce
            place.zero_()
            continue
        split = list(shape)
        split[d:d + 1] = [n, shape[d]]
        place.copy_(g.reshape(split).movedim(d, 0))
    return buf.view(-1)


def _cut(buf: Tensor, shapes, dims, n: int) -> list[Tensor]:
    """Each parameter whole from the rank-major gathered buffer ``buf`` ([rank, flat shards]).
    A parameter's pieces are columns of ``buf``, so joining them makes a copy of its own,
    unless it is the only parameter and split on its first dim (then it is ``buf`` viewed)."""
    fulls, offset = [], 0
    for shape, d in zip(shapes, dims):
        k = math.prod(shape)
        piece = buf[:, offset:offset + k].reshape(n, *shape)  # [rank, *shard]
        full = list(shape)
        full[d] *= n
        fulls.append(piece.movedim(0, d).reshape(full))
        offset += k
    return fulls


def _holding(buf: Tensor, fulls: list[Tensor]) -> Tensor | None:
    """``buf`` if a whole parameter is a view of it (it must live as long), else None: what
    backward's re-gather keeps beside the parameters. Keeping it always held a second
    gathered copy of the layer for its whole backward (16 MiB more than FSDP2 at the
    runtime bench's fsdp peak, the head's weight beside its norm's)."""
    base = buf.untyped_storage().data_ptr()
    return buf if any(f.untyped_storage().data_ptr() == base for f in fulls) else None


@dataclass(eq=False)
class _Gathered:
    """One coalesced gather as forward made it: enough to make it again."""

    index: int
    shards: tuple
    group: str
    shapes: list
    dims: list
    saved: int = 0                 # notes autograd holds and has not handed back yet
    tensors: list | None = None    # [buffer, *whole parameters] while backward uses them
    pending: object = None         # a re-gather issued ahead (backward prefetch)
    kept: list | None = None       # [buffer, *whole parameters] kept from forward (``keep``)


@dataclass(frozen=True, eq=False)
class _Note:
    """What autograd keeps instead of a view of a gathered parameter."""

    gathered: _Gathered
    which: int                     # index into the re-gathered [buffer, *whole parameters]
    size: tuple
    stride: tuple
    offset: int


class RegatherSaved:
    """While active, whole parameters that :func:`gather_wait` makes are not saved for
    backward: autograd keeps a :class:`_Note` of where each saved view lies, and backward
    gathers the layer again at the first note it hands back (issuing the previous
    layer's gather then), cut exactly as in forward, so every saved view is rebuilt with
    the same size, strides and offset. Every rank runs the same backward in the same
    order, so the re-gathers match across ranks. A gather made with ``keep`` is not made
    again: its whole parameters are kept from forward for backward (FSDP2's root module),
    and backward's first note of them issues the previous group's gather. ``groups``: the
    process groups whose gathers this applies to (None: every one); a gather on another
    group is kept from forward to backward as autograd saves it (ZeRO-2 on that mesh
    axis)."""

    def __init__(self, groups=None):
        self.groups = groups            # the process groups whose gathers backward makes again (None: all)
        self.gathered: list[_Gathered] = []
        self.by_storage: dict[int, tuple] = {}  # storage address -> (weak ref, gathered, which)

    def __enter__(self):
        _ACTIVE.append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        _ACTIVE.remove(self)
        return False

    def note(self, shards, group: str, shapes, dims, tensors: list[Tensor], keep: bool = False) -> None:
        if self.groups is not None and group not in self.groups:
            return  # (a group kept gathered, ZeRO-2: autograd saves the whole parameters themselves)
        g = _Gathered(len(self.gathered), tuple(shards), group, list(shapes), list(dims))
        self.gathered.append(g)
        for which, t in enumerate(tensors):
            st = t.untyped_storage()
            self.by_storage[st._cdata] = (StorageWeakRef(st), g, which)
        if keep:  # (held by the notes' hooks: as long as the graph that will use them)
            g.kept = [_holding(tensors[0], tensors[1:]), *tensors[1:]]

    def _pack(self, t: Tensor):
        hit = self.by_storage.get(t.untyped_storage()._cdata) if isinstance(t, Tensor) else None
        if hit is None or hit[0].expired():  # not a gathered parameter (or a dead one's address reused)
            return t
        _, g, which = hit
        g.saved += 1
        return _Note(g, which, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def _unpack(self, x):
        if not isinstance(x, _Note):
            return x
        g = x.gathered
        if g.tensors is None:
            self._issue(g)  # (not a kept group's: it needs none)
            if g.index > 0:  # backward runs the layers in reverse: the previous one is next
                self._issue(self.gathered[g.index - 1])
            g.tensors, g.kept = (g.kept if g.kept is not None else self._wait(g)), None
        out = g.tensors[x.which].as_strided(x.size, x.stride, x.offset)
        g.saved -= 1
        if g.saved <= 0:  # every view handed back: the layer's whole parameters can go
            g.tensors = None
        return out

    @staticmethod
    def _flat(g: _Gathered) -> Tensor:
        shards = [s.detach() for s in g.shards]
        return torch.cat([s.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0].reshape(-1).contiguous()

    def _issue(self, g: _Gathered) -> None:
        if g.saved > 0 and g.tensors is None and g.kept is None and g.pending is None:
            g.pending = _guarded("all_gather (parameters again for backward)", _start, g.group, self._flat(g),
                                 _size(g.group), g.group)

    def _wait(self, g: _Gathered) -> list[Tensor]:
        pending, g.pending = g.pending, None
        n = _size(g.group)
        buf = _guarded("all_gather (parameters again for backward)", _c10d.wait_tensor, g.group, pending).view(n, -1)
        fulls = _cut(buf, g.shapes, g.dims, n)
        return [_holding(buf, fulls), *fulls]


def gather_start(shards: list[Tensor], group: str, grad: str = "rs") -> Tensor:
    """Issue one all-gather of every shard in ``shards`` over ``group``; returns the buffer to
    hand to :func:`gather_wait` (not to read before). ``grad``: ``"rs"`` (the gradients of
    the whole parameters are partial over the group) or ``"slice"`` (they are complete)."""
    return _GatherStart.apply(group, grad, *shards)


def gather_wait(out: Tensor, shapes: list, dims: list[int], group: str, keep: bool = False) -> tuple[Tensor, ...]:
    """The whole parameters from ``out`` (of :func:`gather_start`): parameter i's shard has
    shape ``shapes[i]`` and is split on dim ``dims[i]`` over ``group``. ``keep``: inside
    :class:`RegatherSaved`, keep them for backward instead of gathering them again there."""
    return _GatherWait.apply(out, [tuple(s) for s in shapes], list(dims), group, keep)
