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
  first bucket does), in the order their gradients become ready; a parameter the caller
  names ``alone`` (stpc names tied ones: an embedding table that is also the output
  projection) in a bucket of its own: its gradient is complete only after its last
  reader's backward, and a bucket shared with it, allocated at the first of its gradients
  to arrive, would hold the tied parameter's slot empty until then (the fidelity bench's
  recompute plan peaked at the end of backward with that slot held);
* a gradient hook on each parameter sees the gradient autograd computed for it in this
  backward pass (the sum over all its uses) and copies it into its bucket's flat
  buffer (allocated, not zeroed, when the bucket's first gradient arrives); a second hook,
  after autograd has made that gradient the parameter's ``.grad``, drops it there, so each
  gradient is held once, in its bucket, and not twice until backward ends (measured: a data
  parallel plan with recomputed layers, whose activations are small, peaked at the end of
  backward with every gradient held twice, 565 MiB against its plan's 467 in the
  fifty-seventh session's fidelity run); when every
  gradient of a bucket has arrived, and every earlier bucket has been launched, the
  bucket is all-reduced asynchronously (``async_op=True``) while backward goes on.
  Buckets launch strictly in index order, so every rank issues the same sequence;
* at the end of the backward pass (an autograd engine callback) the reducer launches
  what is left, waits for every bucket, and makes each parameter's ``.grad`` a view of
  its reduced bucket (``gradient_as_bucket_view``: no copy back).
* gradient accumulation (a second backward without ``zero_grad``): a parameter whose
  ``.grad`` already holds a sum keeps it; its hook returns zeros so autograd adds
  nothing, and the reduced gradient is added to ``.grad`` at the end. Buffers are
  allocated per pass, so an earlier pass's ``.grad`` views are never overwritten.
* ``keep_buffers`` (off by default; a compiled program turns it on where its plan's device
  hands freed memory back to the system, ``cost_models.keeps_grad_buckets``, and its memory
  model holds the buckets through forward; ``benchmarks/dp_gap_check.py`` measures what it
  buys): each bucket keeps its last pass's buffer and the next pass writes into it again, as DDP
  keeps its buckets, but only where nothing else holds that buffer any more (the
  ``.grad`` views dropped by ``zero_grad(set_to_none=True)`` and no reference kept), so no
  gradient a caller still holds is overwritten. Memory for time: the buffers stay
  allocated through forward (DDP's peak carries them too), and on a CPU under glibc's
  malloc a fresh buffer's pages are faulted in again every pass, which a kept one is not;
  a caching allocator (CUDA's) hands a freed block back warm, so there it buys little.

It knows nothing of plans or graphs: the compiled model tells it which parameters, in
which order, over which groups (``passes.defer_grad_sync``).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from stpc.runtime.dtensors import grad_like
from stpc.runtime.failure import comm_failure
from stpc.runtime.lazy_wait import settle
from stpc.runtime.reshard import _pg

__all__ = ["GradReducer", "DEFAULT_FIRST_BUCKET_BYTES"]

DEFAULT_FIRST_BUCKET_BYTES = 2**20  # DDP's _DEFAULT_FIRST_BUCKET_BYTES


class _Bucket:
    def __init__(self, group: str, dtype: torch.dtype, device: torch.device, alone: bool = False):
        self.group, self.dtype, self.device, self.alone_param = group, dtype, device, alone
        self.params: list = []
        self.offsets: list[int] = []
        self.numels: list[int] = []
        self.numel = 0
        self.flat: Tensor | None = None      # this pass's gradients, flattened
        self.spare: Tensor | None = None     # the last pass's buffer (``keep_buffers``)
        self.alone = 0                       # its storage's use count when only this bucket holds it
        self.arrived: set[int] = set()       # params whose gradient this pass has produced
        self.accumulate: set[int] = set()    # params whose .grad already held a sum
        self.work = None


def _local(t: Tensor) -> Tensor:
    """This rank's piece of ``t``: a DTensor's local tensor itself (the same storage ``to_local``
    views, without the autograd node ``to_local`` makes, twice per parameter per pass: the
    reducer differentiates nothing), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _use_count(t: Tensor) -> int:
    """How many tensors share ``t``'s storage (as inductor's cudagraph trees ask it)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _buffer(b: _Bucket, zero: bool) -> Tensor:
    """This pass's flat buffer of ``b``: the last pass's, where only ``b`` holds it still
    (``keep_buffers``), else a new one."""
    spare, b.spare = b.spare, None
    if spare is not None and _use_count(spare) == b.alone:
        return spare.zero_() if zero else spare
    flat = (torch.zeros if zero else torch.empty)(b.numel, dtype=b.dtype, device=b.device)
    b.alone = _use_count(flat)
    return flat


def _as_grad(p, local: Tensor) -> Tensor:
    """``local`` as a gradient of ``p`` (a DTensor of p's layout if p is one)."""
    return grad_like(p, local) if isinstance(p, DTensor) else local


class GradReducer:
    """Sum partial gradients over their groups, bucketed and asynchronous; see the module docstring.

    ``params``: ``(parameter, group name)`` in the order backward makes their gradients
    ready (first ready first); a parameter listed twice is counted once. ``alone``: ids of
    parameters that get a bucket of their own (see the module docstring). ``keep_buffers``:
    reuse each bucket's buffer from pass to pass where nothing else holds it (see the module
    docstring).
    """

    def __init__(self, params: list[tuple[torch.nn.Parameter, str]], bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES, keep_buffers: bool = False,
                 alone: frozenset = frozenset()):
        self.keep_buffers = keep_buffers
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}
        self._handles = []
        self.enabled = True
        self._armed = False
        self._next = 0   # the next bucket to launch (buckets go in index order on every rank)
        self.launch_log: list[int] = []  # last pass: gradients arrived when each bucket was launched
        self.launch_at: list[float] = []  # last pass: ``time.perf_counter()`` at each bucket's launch
        self.finish_at: float | None = None  # ... and at the end of backward (benchmarks read them)
        self._arrived = 0
        self._moved: set[int] = set()  # params whose partial gradient this pass went to a bucket alone
        for p, group in params:
            if id(p) in self._where:
                continue
            local = _local(p)
            nbytes = local.numel() * local.element_size()
            cap = min(first_bucket_bytes, bucket_bytes) if len(self.buckets) <= 1 else bucket_bytes
            b = self.buckets[-1] if self.buckets else None
            by_itself = id(p) in alone
            if b is None or (b.group, b.dtype, b.device) != (group, p.dtype, local.device) or (
                    b.params and (b.numel * local.element_size() + nbytes > cap or by_itself or b.alone_param)):
                b = _Bucket(group, p.dtype, local.device, by_itself)
                self.buckets.append(b)
            self._where[id(p)] = (len(self.buckets) - 1, len(b.params))
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numels.append(local.numel())
            b.numel += local.numel()
            self._handles.append(p.register_hook(self._hook_for(p)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._drop_moved))

    def holds(self, params: list[tuple[torch.nn.Parameter, str]]) -> bool:
        """Whether this reducer hooks exactly ``params`` as they are now: the same objects, over
        the same groups, of the dtype, device and size it sized their buckets for. A parameter
        replaced since it was built (a new ``nn.Parameter``, ``load_state_dict(assign=True)``)
        or converted in place (``model.to(dtype)``) fails it: the hook on the old object would
        never fire and the new one's partial gradient would be left unsummed."""
        seen = set()
        for p, group in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            where = self._where.get(id(p))
            if where is None:
                return False
            b, i = self.buckets[where[0]], where[1]
            local = _local(p)  # (runs on every call)
            if (b.params[i] is not p or b.group != group or p.dtype != b.dtype or local.device != b.device
                    or local.numel() != b.numels[i]):
                return False
        return len(seen) == len(self._where)

    # ------------------------------------------------------------------ backward
    def _hook_for(self, p):
        def hook(grad: Tensor) -> Tensor:
            if not self.enabled:
                return grad
            if not self._armed:  # first gradient of this backward pass: finish at its end
                self._armed = True
                self.launch_log, self.launch_at, self._arrived = [], [], 0
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            bi, pi = self._where[id(p)]
            b = self.buckets[bi]
            if b.flat is None:
                b.flat = _buffer(b, zero=False)
            local = _local(grad)
            b.flat[b.offsets[pi]:b.offsets[pi] + local.numel()].view_as(local).copy_(local)
            b.arrived.add(pi)
            self._arrived += 1
            self._launch_ready()
            if p.grad is not None:  # accumulating over passes: add the reduced sum at the end
                b.accumulate.add(pi)
                return torch.zeros_like(grad)
            self._moved.add(id(p))
            return grad  # autograd makes it .grad; _drop_moved drops it (the bucket holds it now)
        return hook

    def _drop_moved(self, p) -> None:
        """After autograd made a moved gradient ``p.grad``: drop it (its bucket holds the copy,
        and the reduced view replaces it at the end of the pass)."""
        if id(p) in self._moved:
            self._moved.discard(id(p))
            p.grad = None

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and len(self.buckets[self._next].arrived) == len(
                self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        if b.flat is None:  # no gradient reached this bucket this pass: its sum is zero
            b.flat = _buffer(b, zero=True)
        elif len(b.arrived) < len(b.params):  # some did not: their share of the sum is zero
            for i, p in enumerate(b.params):
                if i not in b.arrived:
                    b.flat[b.offsets[i]:b.offsets[i] + _local(p).numel()].zero_()
        self.launch_log.append(self._arrived)
        self.launch_at.append(time.perf_counter())
        try:
            b.work = dist.all_reduce(b.flat, group=_pg(b.group), async_op=True)
        except RuntimeError as e:
            raise comm_failure("bucketed gradient all_reduce", b.group, e) from e

    def _finish(self) -> None:
        """End of backward: launch the rest (in order), wait, hand the sums to ``.grad``."""
        self._armed = False
        self.finish_at = time.perf_counter()
        self._moved.clear()  # (a hook's gradient that no accumulation followed: torch.autograd.grad)
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
                b.spare = b.flat if self.keep_buffers else None
                b.flat, b.work = None, None

    def remove(self) -> None:
        """Unhook every parameter."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
