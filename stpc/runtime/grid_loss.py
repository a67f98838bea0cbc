"""Cross-entropy over logits held in a PrimePar grid block layout (issue 14: the loss in grid).

A P(2^k x 2^k) lm_head leaves its logits ``[N, V]`` in the block layout ``B(0, 1)``: device
(r, c) of the 2^k x 2^k grid holds rows block r and vocabulary block c. The loss of a row needs
its whole vocabulary, whose other blocks sit on the devices (r, c') of the same grid row. As
in Megatron's vocabulary-parallel cross-entropy, the row's statistics are exchanged instead of
its logits: the row maximum (one value), then the sum of exponentials and the target's logit
(two values; the target's logit is on one device of the row, zeros elsewhere), each an
all-gather over the axis of which a device reads its grid row's entries (``_row_reduce``).
Every device of a grid row then holds the same row losses; each returns its rows' sum over
``q`` (the grid's side) and, for a mean, over the count of counted targets, so the sum over
the axis (the output's Partial placement) is the loss. Backward needs no exchange: a device's
logits' gradient is ``softmax - onehot`` on its own block, scaled.

The target arrives whole (every row; it is small) and each device reads its grid row's slice.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from stpc.runtime.reshard import _ag, _rank, _size

__all__ = ["grid_cross_entropy"]


def _row_reduce(stats: Tensor, group: str, how: str) -> Tensor:
    """Per local row, ``stats`` [rows, m] reduced (``"sum"`` or ``"max"``) over the devices of
    this device's grid row: one all-gather over the axis group."""
    q = math.isqrt(_size(group))
    r = _rank(group) // q
    mine = _ag(stats.unsqueeze(0).contiguous(), 0, group).narrow(0, r * q, q)   # [q, rows, m]
    return mine.amax(0) if how == "max" else mine.sum(0)


class _GridCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, mean, group):
        n = _size(group)
        q = math.isqrt(n)
        r, c = divmod(_rank(group), q)
        rows, width = logits.shape
        t = target.narrow(0, r * rows, rows)
        keep = t != ignore_index
        local = t - c * width
        here = keep & (local >= 0) & (local < width)
        acc = torch.promote_types(logits.dtype, torch.float32)
        m = _row_reduce(logits.amax(-1, keepdim=True).detach().to(acc), group, "max")  # [rows, 1]
        # the target's logit where this device holds it, 0 elsewhere (where(), not a product:
        # a -inf logit in a column another device's target names must not make a NaN)
        at = logits.gather(1, local.clamp(0, width - 1).unsqueeze(1)).to(acc)
        picked = torch.where(here.unsqueeze(1), at, torch.zeros_like(at))            # [rows, 1]
        e = _copy(logits, acc).sub_(m).exp_()  # one block's working copy, in fp32 at least
        sums = _row_reduce(torch.cat([e.sum(-1, keepdim=True), picked], -1), group, "sum")
        del e
        lse = m + sums[:, :1].log()
        per_row = (lse - sums[:, 1:]).squeeze(1) * keep
        count = (target != ignore_index).sum().to(acc) if mean else lse.new_tensor(1.0)  # (every row's)
        ctx.save_for_backward(logits, lse, local, here, keep, count)
        return (per_row.sum() / (q * count)).to(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        logits, lse, local, here, keep, count = ctx.saved_tensors
        p = _copy(logits, lse.dtype).sub_(lse).exp_()  # softmax, in place in one working copy
        p.scatter_add_(1, local.clamp(0, p.shape[1] - 1).unsqueeze(1), -here.unsqueeze(1).to(p.dtype))
        grad = p.mul_(keep.unsqueeze(1).to(p.dtype) * (g.to(p.dtype) / count))
        return grad.to(logits.dtype), None, None, None, None


def _copy(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A new tensor of ``t``'s values in ``dtype`` (``t.to`` returns ``t`` itself when the
    dtype is already right, and in-place ops on it would change the saved logits)."""
    return torch.empty_like(t, dtype=dtype).copy_(t)


def grid_cross_entropy(logits: Tensor, target: Tensor, group: str, ignore_index: int = -100,
                       reduction: str = "mean") -> Tensor:
    """``cross_entropy(logits, target)`` with ``logits`` [N, V] held in a grid block layout
    (rows over the grid's rows, the vocabulary over its columns, axis group ``group``: a
    2^k x 2^k grid) and ``target`` [N] whole: this device's share of the loss, the whole loss
    being the sum over the axis (Partial). ``reduction`` ``"mean"`` (over the targets not
    ``ignore_index``) or ``"sum"``. Differentiable in ``logits``."""
    n = _size(group)
    q = math.isqrt(n)
    if q * q != n or q < 2:
        raise ValueError(f"grid_cross_entropy needs an axis group of 4, 16, 64, ... ranks; this one has {n}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"grid_cross_entropy: reduction {reduction!r}; only 'mean' and 'sum' keep a grid layout")
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0] * q:
        raise ValueError(f"grid_cross_entropy: logits {tuple(logits.shape)} (a block of [N, V]) and target "
                         f"{tuple(target.shape)} (all N rows) do not fit a {q}x{q} grid")
    return _GridCrossEntropy.apply(logits, target, int(ignore_index), reduction == "mean", group)
