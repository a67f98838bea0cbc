"""grid_norm: whole 1-D operands over a PrimePar grid layout: a LayerNorm and an RMSNorm
(statistics reduced across the grid row), a bias add, and a grid column's slice of a 1-D
operand for any elementwise op.

A P(2^k x 2^k) linear leaves its output in the block layout ``B(i, j)``: rows (dim i) split
over the grid's rows, the normalised dim (j, the last) over its columns. To normalise that
tensor where it lies, device (r, c) needs the mean and variance of each of its rows over the
whole last dim, whose other pieces sit on the devices (r, c') of its grid row. They exchange
per-row statistics, not activations: each device's (mean, M2) of its piece, 2 values per
local row, all-gathered over the axis group (its own grid row's entries used; a row group is
not a process group of its own, and the exchange is tiny). The pieces combine exactly
(Chan's parallel variance: equal counts, so the mean is the pieces' mean and M2 their M2s
plus the spread of their means), then every device normalises its own block. Backward needs
two more sums over the last dim (of ``g = dy * weight`` and of ``g * xhat``), exchanged the
same way.

An RMSNorm (``frontend.normalize`` fuses Llama's written-out one into ``rms_norm`` without
its weight, whose ``mul`` stays an elementwise op) needs one per-row value each way: the
sum of squares of the row's pieces forward, the sum of ``dy * xhat`` backward.

The weight and bias are whole (Replicate) on every device; each reads the slice of its grid
column. Their gradients come back whole-sized, zero outside that slice: summed over the
axis group (the Replicate parameter's usual gradient reduction: the op splits its work on
the axis) they are the complete gradients. ``grid_column`` is that slice on its own, for an
elementwise op whose 1-D operand runs along the block's last dim (RMSNorm's weight).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from stpc.runtime.reshard import _ag, _rank, _size

__all__ = ["grid_layer_norm", "grid_rms_norm", "grid_bias_add", "grid_column"]


def _row_sums(stats: Tensor, group: str) -> Tensor:
    """Per local row, ``stats`` [..., m] summed over the devices of this device's grid row
    (one all-gather of every device's [..., m] over the axis group)."""
    n = _size(group)
    q = math.isqrt(n)
    r = _rank(group) // q
    everyone = _ag(stats.unsqueeze(0).contiguous(), 0, group)   # [n, ..., m], by group rank
    return everyone.narrow(0, r * q, q)


def _grid_side(group: str, what: str) -> int:
    """The side of the 2^k x 2^k grid axis group ``group`` forms; an error (before any
    collective, so no rank waits on it) if it forms none."""
    n = _size(group)
    q = math.isqrt(n)
    if q * q != n or q < 2:
        raise ValueError(f"{what} needs an axis group of 4, 16, 64, ... ranks (a 2^k x 2^k grid); this one has {n}")
    return q


def _acc(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _column_slice(t: Tensor | None, group: str, width: int) -> Tensor | None:
    if t is None:
        return None
    c = _rank(group) % math.isqrt(_size(group))
    return t.narrow(0, c * width, width)


class _GridLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):
        q = math.isqrt(_size(group))
        width = x.shape[-1]
        full = width * q
        xf = x.to(_acc(x))  # statistics in fp32 at least, as aten's layer_norm kernels keep them
        mean_i = xf.mean(-1, keepdim=True)
        m2_i = (xf - mean_i).square().sum(-1, keepdim=True)
        row = _row_sums(torch.cat([mean_i, m2_i], -1), group)  # [q, ..., 2]
        means, m2s = row[..., 0:1], row[..., 1:2]
        mean = means.mean(0)
        var = (m2s.sum(0) + width * (means - mean).square().sum(0)) / full
        rstd = torch.rsqrt(var + eps)
        xhat = (xf - mean) * rstd
        w, b = _column_slice(weight, group, width), _column_slice(bias, group, width)
        out = xhat if w is None else xhat * w
        if b is not None:
            out = out + b
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, mean, rstd, weight = ctx.saved_tensors
        group = ctx.group
        width = x.shape[-1]
        full = width * math.isqrt(_size(group))
        dyf = dy.to(mean.dtype)
        xhat = (x.to(mean.dtype) - mean) * rstd
        w = _column_slice(weight, group, width)
        g = dyf if w is None else dyf * w
        sums = _row_sums(torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], -1), group).sum(0)
        dx = rstd * (g - sums[..., 0:1] / full - xhat * (sums[..., 1:2] / full))
        dw = db = None
        lead = tuple(range(dy.dim() - 1))
        if weight is not None and ctx.needs_input_grad[1]:
            dw = weight.new_zeros(weight.shape, dtype=mean.dtype)
            _column_slice(dw, group, width).copy_((dyf * xhat).sum(lead))
            dw = dw.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = torch.zeros(full, dtype=mean.dtype, device=dy.device)
            _column_slice(db, group, width).copy_(dyf.sum(lead))
            db = db.to(ctx.bias_dtype)
        return dx.to(x.dtype), dw, db, None, None


def grid_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group: str) -> Tensor:
    """``layer_norm`` over the last dim of ``x``, held in a grid block layout (last dim split
    over the grid's columns of axis group ``group``, a 2^k x 2^k grid): this device's block
    of the result. ``weight``/``bias``: whole. Differentiable (see the module docstring)."""
    _grid_side(group, "grid_layer_norm")
    return _GridLayerNorm.apply(x, weight, bias, float(eps), group)


def grid_bias_add(x: Tensor, bias: Tensor, group: str) -> Tensor:
    """``x + bias`` where ``x`` is this device's block of a grid layout whose last dim is split
    over the grid's columns (a P(2^k x 2^k) linear's output) and ``bias`` is whole: the slice
    of this device's grid column is added. Its gradient comes back whole-sized, zero outside
    that slice (summed over the axis group, as a Replicate operand's is, it is complete)."""
    _grid_side(group, "grid_bias_add")
    return x + grid_column(bias, group)


class _GridRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps, group):
        q = math.isqrt(_size(group))
        full = x.shape[-1] * q
        xf = x.to(_acc(x))  # (as aten's rms_norm: in fp32 at least)
        squares = _row_sums(xf.square().sum(-1, keepdim=True), group).sum(0)  # [..., 1]
        rstd = torch.rsqrt(squares / full + eps)
        ctx.save_for_backward(x, rstd)
        ctx.group = group
        return (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        full = x.shape[-1] * math.isqrt(_size(ctx.group))
        dyf = dy.to(rstd.dtype)
        xhat = x.to(rstd.dtype) * rstd
        dot = _row_sums((dyf * xhat).sum(-1, keepdim=True), ctx.group).sum(0)
        return (rstd * (dyf - xhat * (dot / full))).to(x.dtype), None, None


def grid_rms_norm(x: Tensor, eps: float, group: str) -> Tensor:
    """``rms_norm`` (no weight) over the last dim of ``x``, held in a grid block layout (last
    dim split over the grid's columns of axis group ``group``, a 2^k x 2^k grid): this
    device's block of ``x * rsqrt(mean(x ** 2) + eps)``, the mean over the whole last dim.
    Differentiable; saves ``x`` and the per-row ``rsqrt`` for backward, as aten's composite
    does (see the module docstring)."""
    _grid_side(group, "grid_rms_norm")
    return _GridRMSNorm.apply(x, float(eps), group)


class _GridColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, width, group, dim):
        ctx.shape, ctx.group, ctx.width, ctx.dim = t.shape, group, width, dim
        return _column_slice(t.movedim(dim, 0), group, width).movedim(0, dim)

    @staticmethod
    def backward(ctx, g):
        whole = g.new_zeros(ctx.shape)
        _column_slice(whole.movedim(ctx.dim, 0), ctx.group, ctx.width).copy_(g.movedim(ctx.dim, 0))
        return whole, None, None, None


def grid_column(t: Tensor, group: str, dim: int = -1) -> Tensor:
    """This device's grid column's slice of ``t`` along ``dim`` (its last by default): ``t``
    whole beside a block layout whose columns split that dim (an elementwise op's operand
    along the block's last dim, such as RMSNorm's weight; an attention mask that varies per
    head beside heads over the grid's columns, BLOOM's ALiBi bias) over the grid's columns
    of axis group ``group``. Its gradient comes back whole-sized, zero outside the slice
    (see the module docstring)."""
    q = _grid_side(group, "grid_column")
    dim = dim % t.dim()
    if t.shape[dim] % q:
        raise ValueError(f"grid_column: dim {dim} ({t.shape[dim]}) does not split over {q} grid columns")
    return _GridColumn.apply(t, t.shape[dim] // q, group, dim)
