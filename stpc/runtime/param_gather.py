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

Plain differentiable distributed functions of local tensors; they know nothing of plans.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from stpc.runtime.reshard import _c10d, _guarded, _rank, _size

__all__ = ["gather_start", "gather_wait"]


def _start(flat: Tensor, n: int, group: str) -> Tensor:
    return _c10d.all_gather_into_tensor(flat, n, group)


def _reduce_scatter(flat: Tensor, n: int, group: str) -> Tensor:
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", n, group))


class _GatherStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, grad, *shards):
        ctx.group, ctx.grad = group, grad
        ctx.shapes = [s.shape for s in shards]
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
    def forward(ctx, out, shapes, dims, group):
        n = _size(group)
        ctx.shapes, ctx.dims, ctx.n, ctx.like = shapes, dims, n, (out.dtype, out.device)
        # eager: this gather's start node, so backward can launch its reduce-scatter early
        start = out.grad_fn
        ctx.start = start if (isinstance(start, _GatherStart._backward_cls) and start.grad == "rs"
                              and not torch.compiler.is_compiling()) else None
        ctx.group = group
        buf = _c10d.wait_tensor(out).view(n, -1)
        fulls, offset = [], 0
        for shape, d in zip(shapes, dims):
            k = math.prod(shape)
            piece = buf[:, offset:offset + k].reshape(n, *shape)  # [rank, *shard]
            full = list(shape)
            full[d] *= n
            fulls.append(piece.movedim(0, d).reshape(full))
            offset += k
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        parts = []
        for g, shape, d in zip(grads, ctx.shapes, ctx.dims):
            if g is None:  # a parameter no consumer differentiates: no gradient to reduce
                parts.append(torch.zeros(n, math.prod(shape), dtype=ctx.like[0], device=ctx.like[1]))
                continue
            split = list(shape)
            split[d:d + 1] = [n, shape[d]]
            parts.append(g.reshape(split).movedim(d, 0).reshape(n, -1))  # rank-major, as gathered
        flat = torch.cat(parts, dim=1).reshape(-1)
        start, ctx.start = ctx.start, None
        if start is None:
            return flat, None, None, None
        # launch the layer's reduce-scatter now: it travels while backward computes the earlier
        # layers, and the start node (run later by the engine) waits for it; autograd gets a
        # stand-in of the right shape (no memory), which the start node ignores
        start.pending = _guarded("reduce_scatter (coalesced parameter gradients)", _c10d.reduce_scatter_tensor,
                                 ctx.group, flat, "sum", n, ctx.group)
        return torch.zeros((), dtype=flat.dtype, device=flat.device).expand(flat.shape), None, None, None


def gather_start(shards: list[Tensor], group: str, grad: str = "rs") -> Tensor:
    """Issue one all-gather of every shard in ``shards`` over ``group``; returns the buffer to
    hand to :func:`gather_wait` (not to read before). ``grad``: ``"rs"`` (the gradients of
    the whole parameters are partial over the group) or ``"slice"`` (they are complete)."""
    return _GatherStart.apply(group, grad, *shards)


def gather_wait(out: Tensor, shapes: list, dims: list[int], group: str) -> tuple[Tensor, ...]:
    """The whole parameters from ``out`` (of :func:`gather_start`): parameter i's shard has
    shape ``shapes[i]`` and is split on dim ``dims[i]`` over ``group``."""
    return _GatherWait.apply(out, [tuple(s) for s in shapes], list(dims), group)
