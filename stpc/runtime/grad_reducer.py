"""grad_reducer: data-parallel gradients summed in buckets, overlapped with backward (DDP's reducer).

In: parameters (leaf tensors, DTensors included) whose local gradient is *partial* over
a process group (each rank holds its share of the sum), each with that group's name, in
the order backward completes their gradients, and a bucket size. Out: after every
backward pass, each such parameter's ``.grad`` holds the complete sum.

How (the design of ``torch.nn.parallel.DistributedDataParallel``'s reducer, for
parameters DDP cannot wrap: stpc's program is one graph, its parameters DTensors of
several layouts, and only some of them are data-parallel, over some mesh axes):

* buckets: consecutive parameters of one group and dtype, up to ``bucket_bytes`` (the
  first bucket ``first_bucket_bytes``, so communication starts early, as DDP's 1 MiB
  first bucket does), in the order their gradients become ready;
* a gradient hook sees the gradient autograd computed for a parameter in this backward
  pass (the sum over all its uses) and copies it into its bucket's flat buffer
  (allocated, not zeroed, when the bucket's first gradient arrives). A plain parameter
  carries the hook itself. A DTensor parameter's program reads a leaf aliasing its local
  shard (:meth:`GradReducer.local_input`, a :class:`LocalLeaves`) that carries the hook: its
  gradient reaches the reducer as the local tensor backward computed, with no DTensor
  wrapped around it and stored in ``.grad`` on the way (``DTensor.to_local``'s backward
  does that per parameter per pass, a Python-level cost DDP's plain parameters do not
  pay; the leaf's partial ``.grad`` is dropped at the end, as the DTensor's was). The
  parameter itself is then not in the autograd graph: ``torch.autograd.grad(loss,
  params)`` and ``backward(inputs=params)`` need the reducer off (``bucket_mb=None``),
  and hooks a user puts on it after the forward do not fire. When every
  gradient of a bucket has arrived, and every earlier bucket has been launched, the
  bucket is all-reduced asynchronously (``async_op=True``) while backward goes on.
  Buckets launch strictly in index order, so every rank issues the same sequence;
* at the end of the backward pass (an autograd engine callback) the reducer launches
  what is left, waits for every bucket, and makes each parameter's ``.grad`` a view of
  its reduced bucket (``gradient_as_bucket_view``: no copy back). The gradient autograd
  accumulated in the meantime was this pass's partial one; it is dropped.
* gradient accumulation (a second backward without ``zero_grad``): a parameter whose
  ``.grad`` already holds a sum keeps it; its hook returns zeros so autograd adds
  nothing, and the reduced gradient is added to ``.grad`` at the end. Buffers are
  allocated per pass, so an earlier pass's ``.grad`` views are never overwritten.

It knows nothing of plans or graphs: the compiled model tells it which parameters, in
which order, over which groups (``passes.defer_grad_sync``).
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from stpc.runtime.failure import comm_failure
from stpc.runtime.lazy_wait import settle
from stpc.runtime.reshard import _pg

__all__ = ["GradReducer", "LocalLeaves", "DEFAULT_FIRST_BUCKET_BYTES"]

DEFAULT_FIRST_BUCKET_BYTES = 2**20  # DDP's _DEFAULT_FIRST_BUCKET_BYTES


class _Bucket:
    def __init__(self, group: str, dtype: torch.dtype, device: torch.device):
        self.group, self.dtype, self.device = group, dtype, device
        self.params: list = []
        self.offsets: list[int] = []
        self.numel = 0
        self.flat: Tensor | None = None      # this pass's gradients, flattened
        self.arrived: set[int] = set()       # params whose gradient this pass has produced
        self.accumulate: set[int] = set()    # params whose .grad already held a sum
        self.work = None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shard(p: Tensor) -> Tensor:
    """``p``'s local values for their metadata (no autograd op, unlike ``to_local``)."""
    return p._local_tensor if isinstance(p, DTensor) else p


class LocalLeaves:
    """The autograd leaves a compiled model's programs read for the DTensor parameters its
    reducers sum: one per parameter, aliasing its local shard, shared by every program (two
    forwards of two programs before one backward read one leaf, and autograd sums the two
    uses before its hook fires once, as it would on the parameter itself). Made at a
    pass's first read, forgotten at the pass's end (``end_pass``), so no leaf outlives the
    shard it aliases for long. The gradient goes to ``active``, the reducer of the program
    that ran last (the one the model arms, as it enables only that reducer's hooks)."""

    def __init__(self):
        self.active: GradReducer | None = None
        self._leaves: dict[int, tuple[Tensor, Tensor]] = {}  # id(p) -> (leaf, the shard it aliases)

    def read(self, p: DTensor) -> Tensor:
        shard = p._local_tensor
        leaf, base = self._leaves.get(id(p), (None, None))
        if base is not shard or leaf.data_ptr() != shard.data_ptr() or leaf.shape != shard.shape:
            leaf = shard.detach().requires_grad_()
            leaf.register_hook(functools.partial(self._arrive, p))
            leaf.register_post_accumulate_grad_hook(functools.partial(self._accumulated, p))
            self._leaves[id(p)] = (leaf, shard)
        return leaf

    def _arrive(self, p, grad: Tensor) -> Tensor:
        red = self.active
        if red is None or not red.enabled or not red.holds((p,)):
            raise RuntimeError(
                f"stpc: the gradient of a data-parallel parameter ({tuple(p.shape)}) reached no gradient "
                f"reducer that sums it: one backward pass ran through programs planned for different call "
                f"shapes that do not share it. Fix: call backward on each call's loss before the next call "
                f"with another shape, or compile with bucket_mb=None")
        red.receive(p, grad)
        return grad

    def _accumulated(self, p, leaf: Tensor) -> None:
        # accumulating over passes: p.grad gets the reduced sum at the end; the partial one goes now
        red = self.active
        if red is not None and red.accumulating(p):
            leaf.grad = None

    def end_pass(self) -> None:
        for leaf, _ in self._leaves.values():
            leaf.grad = None
        self._leaves.clear()


def _as_grad(p, local: Tensor) -> Tensor:
    """``local`` as a gradient of ``p`` (a DTensor of p's layout if p is one). Where the
    local piece is laid out as p's own shard, p's spec describes it and the DTensor is made
    directly (``from_local`` is an autograd function that rebuilds the spec: per parameter
    per step, that is the reducer's largest Python cost after the hooks)."""
    if isinstance(p, DTensor):
        mine = p._local_tensor
        if (local.shape == mine.shape and local.stride() == mine.stride()
                and not any(pl.is_partial() for pl in p.placements)):  # (from_local makes Partial Replicate)
            return DTensor(local, copy.copy(p._spec), requires_grad=False)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return local


class GradReducer:
    """Sum partial gradients over their groups, bucketed and asynchronous; see the module docstring.

    ``params``: ``(parameter, group name)`` in the order backward makes their gradients
    ready (first ready first); a parameter listed twice is counted once.
    """

    def __init__(self, params: list[tuple[torch.nn.Parameter, str]], bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES, leaves: LocalLeaves | None = None):
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}
        self._handles = []
        self.enabled = True
        self._armed = False
        self._next = 0   # the next bucket to launch (buckets go in index order on every rank)
        self.launch_log: list[int] = []  # last pass: gradients arrived when each bucket was launched
        self._arrived = 0
        self._hooks: dict[int, object] = {}  # id(p) -> its gradient hook
        self._param_of: dict[int, tuple] = {}  # id(p) -> (p, dtype, device, local numel) as made
        self.leaves = leaves if leaves is not None else LocalLeaves()
        for p, group in params:
            if id(p) in self._where:
                continue
            local = _shard(p)
            nbytes = local.numel() * local.element_size()
            cap = min(first_bucket_bytes, bucket_bytes) if len(self.buckets) <= 1 else bucket_bytes
            b = self.buckets[-1] if self.buckets else None
            if b is None or (b.group, b.dtype, b.device) != (group, p.dtype, local.device) or (
                    b.params and (b.numel * local.element_size() + nbytes > cap)):
                b = _Bucket(group, p.dtype, local.device)
                self.buckets.append(b)
            self._where[id(p)] = (len(self.buckets) - 1, len(b.params))
            self._param_of[id(p)] = (p, p.dtype, local.device, local.numel())
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numel += local.numel()
            self._hooks[id(p)] = self._hook_for(p)
            if not isinstance(p, DTensor):
                self._handles.append(p.register_hook(self._hooks[id(p)]))
            # a DTensor's hook goes on its local_input leaf, or on it where it has hooks of its own

    def holds(self, params) -> bool:
        """Whether every one of ``params`` is a parameter this reducer was made for: the very
        object, of the dtype, device and local size its bucket slot has."""
        for p in params:
            got = self._param_of.get(id(p))
            shard = _shard(p)
            if got is None or got != (p, p.dtype, shard.device, shard.numel()):
                return False
        return True

    def local_input(self, p) -> Tensor:
        """What this pass's program reads for parameter ``p``: its local values, with autograd
        bringing their gradient to this reducer. For a DTensor with no hooks of its own (the
        usual case), the leaf of ``self.leaves`` aliasing its local shard (see the module
        docstring); else ``p.to_local()`` with the reducer's hook on ``p``, so the user's
        hooks see its DTensor gradient as they expect."""
        if not isinstance(p, DTensor):
            return p
        if not (p.requires_grad and torch.is_grad_enabled()):
            return p.to_local()
        hook = self._hooks[id(p)]
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            if not any(h is hook for h in (p._backward_hooks or {}).values()):
                self._handles.append(p.register_hook(hook))
            return p.to_local()
        return self.leaves.read(p)

    # ------------------------------------------------------------------ backward
    def _hook_for(self, p):
        def hook(grad: Tensor) -> Tensor:
            if not self.enabled:
                return grad
            if self.receive(p, grad):  # accumulating over passes: autograd adds nothing now
                return torch.zeros_like(grad)
            return grad  # autograd makes it .grad for now; replaced by the reduced view at the end
        return hook

    def receive(self, p, grad: Tensor) -> bool:
        """This pass's gradient of ``p`` (the sum over its uses) into its bucket, launching
        what is then complete. True when ``p.grad`` already holds a sum (gradient
        accumulation): the reduced gradient is added to it at the end, and the caller must
        not let autograd add this partial one."""
        if not self._armed:  # first gradient of this backward pass: finish at its end
            self._armed = True
            self.launch_log, self._arrived = [], 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bi, pi = self._where[id(p)]
        b = self.buckets[bi]
        if b.flat is None:
            b.flat = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        local = _local(grad)
        slot = b.flat[b.offsets[pi]:b.offsets[pi] + local.numel()].view_as(local)
        if pi in b.arrived:  # a second gradient of p in one pass (two of its reads autograd did not sum)
            if b.work is not None:
                raise RuntimeError(
                    f"stpc: a second gradient of a data-parallel parameter ({tuple(p.shape)}) arrived in one "
                    f"backward pass after its bucket was already being summed over the ranks. Fix: run one "
                    f"backward per forward of the compiled model, or compile with bucket_mb=None")
            slot.add_(local)
        else:
            slot.copy_(local)
            b.arrived.add(pi)
            self._arrived += 1
            self._launch_ready()
        if p.grad is not None:
            b.accumulate.add(pi)
            return True
        return False

    def accumulating(self, p) -> bool:
        """Whether this pass adds ``p``'s reduced gradient to a ``.grad`` that already holds a sum."""
        bi, pi = self._where[id(p)]
        return pi in self.buckets[bi].accumulate

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and len(self.buckets[self._next].arrived) == len(
                self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        if b.flat is None:  # no gradient reached this bucket this pass: its sum is zero
            b.flat = torch.zeros(b.numel, dtype=b.dtype, device=b.device)
        elif len(b.arrived) < len(b.params):  # some did not: their share of the sum is zero
            for i, p in enumerate(b.params):
                if i not in b.arrived:
                    b.flat[b.offsets[i]:b.offsets[i] + _local(p).numel()].zero_()
        self.launch_log.append(self._arrived)
        try:
            b.work = dist.all_reduce(b.flat, group=_pg(b.group), async_op=True)
        except RuntimeError as e:
            raise comm_failure("bucketed gradient all_reduce", b.group, e) from e

    def _finish(self) -> None:
        """End of backward: launch the rest (in order), wait, hand the sums to ``.grad``."""
        self._armed = False
        try:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
                self._next += 1
            for b in self.buckets:
                b.work.wait()
            settle()  # the step's loss, summed ahead of the buckets: done, and waited now
        except RuntimeError as e:
            raise comm_failure("bucketed gradient all_reduce", None, e) from e
        finally:
            self._next = 0
            self.leaves.end_pass()  # this pass's partial gradients, as autograd stored them, dropped
        with torch.no_grad():
            for b in self.buckets:
                for i, p in enumerate(b.params):
                    if i not in b.arrived:
                        continue  # no gradient reached it this pass (on any rank: one program)
                    local = _local(p)
                    piece = b.flat[b.offsets[i]:b.offsets[i] + local.numel()].view(local.shape)
                    if i in b.accumulate:
                        _local(p.grad).add_(piece)
                    else:
                        p.grad = _as_grad(p, piece)
                b.arrived.clear()
                b.accumulate.clear()
                b.flat, b.work = None, None

    def remove(self) -> None:
        """Unhook every parameter; leaves no longer send it gradients."""
        self.enabled = False
        if self.leaves.active is self:
            self.leaves.active = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
