"""lazy_wait: a collective's result handed out before it is waited, waited where it is read.

In: the raw output of a functional collective issued and not waited (``all_reduce_start``).
Out: a tensor that stands for it: the first op that reads its values waits for the
collective; what reads only its shape, dtype and device does not.

Why: the step's loss is a sum over ranks (``insert_collectives`` replicates the outputs).
Waited where the forward computes it, that sum makes every rank wait for the slowest one's
forward before its own backward can start, a synchronisation no data-parallel engine has
(DDP reduces the loss, if at all, after backward). Its value is read by the user, later
(``loss.item()``); ``loss.backward()`` reads only its metadata: the engine seeds the
gradient with ``ones_like``. So the sum rides ahead of the gradient buckets on the comm
thread, and the rank goes on into backward.

How: :class:`LoadedLater` is torch's ``AsyncCollectiveTensor`` (the wrapper whose first use
waits; views stay wrapped), except that the ``*_like`` factories, which read metadata
only, do not wait. The autograd dual is the identity (``all_reduce_start``'s sum
with ``grad="identity"``). Under ``torch.compile`` the result is waited in place:
inductor schedules the wait itself.

The same wrapper carries a parameter's gradient all-reduce that backward issues and does
not wait (:func:`read_later`, ``runtime.grad_all_reduce(..., wait="on_read")``): what reads
it is the sum of the parameter's gradients at the end of backward, so the reduction runs
beside the rest of backward, as the cost model charges a parameter's gradient sync.

Every result handed out is also waited at the latest by :func:`settle` (the gradient
reducer's end of backward, the next call of the program), so no collective is left
unwaited when its tensor is never read.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor

__all__ = ["LoadedLater", "read_later", "wait_on_read", "settle"]

_c10d = torch.ops._c10d_functional

aten = torch.ops.aten
# ops that read a tensor's metadata only: they make a new tensor "like" it
_METADATA_ONLY = {aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
                  aten.full_like.default}

# key of each result handed out and not waited yet -> the collective's raw output (the raw
# output kept, so it is waited even if its result dies). The key is a count the result
# carries, not its id: a result dropped unread frees its id for the next one, whose entry
# would replace it, and the first collective would never be waited.
_pending: dict[int, Tensor] = {}
_keys = itertools.count()


class LoadedLater(AsyncCollectiveTensor):
    """A collective's output, waited by the first op that reads its values."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA_ONLY:
            kwargs = dict(kwargs or {})
            like = args[0]
            return func(torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, device=like.device),
                        *args[1:], **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def trigger_wait(self):
        _pending.pop(pending_key(self), None)
        return super().trigger_wait()

    def __repr__(self) -> str:  # the loss prints as its value, as a plain tensor would (waited)
        return repr(self.trigger_wait())


class _WaitOnRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        if torch.compiler.is_compiling():
            return _c10d.wait_tensor(t).view_as(t)
        return read_later(t)

    @staticmethod
    def backward(ctx, g):
        return g


def read_later(raw: Tensor) -> Tensor:
    """``raw`` (a functional collective's output, issued, not waited) as a :class:`LoadedLater`,
    waited by the first op that reads it or by :func:`settle`. Not differentiable: for a
    result computed in backward; :func:`wait_on_read` is the forward's."""
    out = LoadedLater(raw)
    out._stpc_pending_key = next(_keys)
    _pending[out._stpc_pending_key] = raw
    return out


def pending_key(t: Tensor) -> int | None:
    """The key under which :data:`_pending` holds ``t``'s collective (None: ``t`` is not a
    result :func:`read_later` handed out; a view of one is not one either)."""
    return getattr(t, "_stpc_pending_key", None)


def wait_on_read(t: Tensor) -> Tensor:
    """``t`` (a collective issued earlier, not waited), waited by the first op reading it."""
    return _WaitOnRead.apply(t)


def settle() -> None:
    """Wait every result :func:`wait_on_read` handed out that nothing has read yet."""
    for raw in list(_pending.values()):
        _c10d.wait_tensor(raw)
    _pending.clear()
