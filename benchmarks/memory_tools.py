"""Memory cross-checks of single-device training, for the benchmarks and tests that measure.

Two tools, neither part of the planner (whose one memory model is
``stpc.cost_models.MemoryModel``):

* :func:`measure_training_peak`: the measured peak of real AdamW steps, counted by
  ``torch.distributed._tools.mem_tracker.MemTracker``;
* :func:`estimate_training_peak`: an independent oracle of the same peak from shapes
  alone, described below, used to check the measurement and the closed form.

Peak-memory estimate of one single-device training step, from shapes alone.

The model runs forward once on FakeTensors (no real memory). Then, instead of running
backward, we *walk* the autograd graph it built and replay the autograd engine's
bookkeeping with byte counts:

* saved activations: every tensor a graph node keeps for its backward (the node's
  ``_saved_*`` fields), deduplicated by storage; parameters and inputs excluded (counted
  on their own). A storage is freed when the last node that saved it has run backward.
* gradient buffers: node ``j`` receives grads of the sizes in ``j._input_metadata`` and
  produces one grad per ``next_functions`` edge. Nodes of view ops and additions return
  aliases of their incoming grad (no new memory); an edge fed twice accumulates in place
  unless the buffered grad is an alias, in which case the sum is a new tensor.
  ``AccumulateGrad`` turns its buffer into ``param.grad`` (persistent).
* nodes run in the engine's order: among ready nodes, highest sequence number first.

The step's peak is then (``cost_models.memory.training_step_peak``)

    weights + optimizer state + max(forward peak, backward peak, grads + AdamW scratch)

Assumptions, all stated rather than tuned: steady state (optimizer state exists),
``zero_grad(set_to_none=True)`` each step, no activation checkpointing, fp32 AdamW
state (exp_avg, exp_avg_sq and a 4-byte ``step`` per parameter). Not modelled: scratch
inside a single backward formula (e.g. SDPA backward's internal buffers) and allocator
rounding.
"""
from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._pytree import tree_flatten

from stpc.cost_models.memory import adamw_step_transient_bytes, training_step_peak

# Backward nodes whose grad outputs alias their grad input (view ops, and add/sub whose
# backward passes the same tensor to both operands).
_ALIAS_NODE = re.compile(r"^(Unsafe)?View|^TBackward|^Transpose|^Permute|^Squeeze|^Unsqueeze|"
                         r"^Alias|^Reshape|^Detach|^AddBackward0$|^AsStrided")


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of a single-device training step; ``peak`` is the estimate, ``phase`` where it
    occurs ("forward", "backward" or "optimizer")."""

    params: int
    grads: int
    optimizer: int
    inputs: int
    activations: int
    forward_peak: int
    backward_peak: int
    step_transient: int
    peak: int
    phase: str


def _storage_key(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _meta_bytes(meta) -> int:
    return math.prod(meta.shape) * torch.empty((), dtype=meta.dtype, device="meta").element_size()


def _saved_tensors(node) -> list[torch.Tensor]:
    out = []
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            v = getattr(node, name)
        except RuntimeError:  # a saved tensor already freed (cannot happen before backward)
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    if hasattr(node, "saved_tensors"):  # custom autograd.Function
        out.extend(t for t in node.saved_tensors if isinstance(t, torch.Tensor))
    return out


class _OutputRecorder(TorchDispatchMode):
    """Records the bytes of every new storage an op creates during the fake forward."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[object, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                k = _storage_key(t)
                if k not in ins:  # a view or in-place result allocates nothing new
                    self.outputs.append((k, _nbytes(t)))
        return out


def _backward_walk(root, excluded: set, param_bytes: dict) -> tuple[int, int]:
    """Replay the autograd engine from ``root`` (the loss's grad_fn). Returns
    (peak bytes of activations + grads + grad buffers during backward, saved activation
    bytes at the start of backward)."""
    # Discover the graph, dependency counts and who saves which storage.
    deps: dict = {}
    saved: dict = {}  # node -> list of storage keys it saved
    refs: dict = {}  # storage key -> number of nodes that saved it
    size: dict = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        keys = set()
        for t in _saved_tensors(node):
            k = _storage_key(t)
            if k in excluded:
                continue
            keys.add(k)
            size[k] = _nbytes(t)
        saved[node] = keys
        for k in keys:
            refs[k] = refs.get(k, 0) + 1
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    act_live = sum(size.values())
    act_start = act_live

    # Grad tensors: id -> [bytes, refcount]; buffers: (node, input_nr) -> grad id.
    grads: dict[int, list] = {}
    buffers: dict[tuple, int] = {}
    next_id = [0]

    def new_grad(nbytes):
        next_id[0] += 1
        grads[next_id[0]] = [nbytes, 0]
        return next_id[0]

    def ref(gid):
        grads[gid][1] += 1

    def unref(gid):
        grads[gid][1] -= 1
        if grads[gid][1] == 0:
            del grads[gid]

    live_grads = lambda: sum(b for b, _ in grads.values())  # noqa: E731
    param_grads = 0
    gid = new_grad(_meta_bytes(root._input_metadata[0]))
    buffers[(root, 0)] = gid
    ref(gid)
    ready = [(-root._sequence_nr(), id(root), root)]
    peak = 0
    while ready:
        _, _, node = heapq.heappop(ready)
        in_ids = [buffers.pop((node, i)) for i in range(len(node._input_metadata)) if (node, i) in buffers]
        if type(node).__name__ == "AccumulateGrad":
            # The buffer becomes param.grad (tied parameters: accumulated in place).
            var = node.variable
            key = _storage_key(var)
            if key not in param_bytes:
                param_bytes[key] = ("seen", _nbytes(var))
            state, nb = param_bytes[key]
            if state == "seen":
                param_bytes[key] = ("has_grad", nb)
                param_grads += nb
            peak = max(peak, act_live + param_grads + live_grads())
            for g in in_ids:
                unref(g)
            continue
        alias = bool(_ALIAS_NODE.match(node.name())) and len(in_ids) == 1
        out_edges = [(nxt, i) for nxt, i in node.next_functions if nxt is not None]
        produced = []
        for nxt, i in out_edges:
            if alias:
                g = in_ids[0]
            else:
                g = new_grad(_meta_bytes(nxt._input_metadata[i]))
            ref(g)
            produced.append(((nxt, i), g))
        peak = max(peak, act_live + param_grads + live_grads())
        for key, g in produced:
            old = buffers.get(key)
            if old is None:
                buffers[key] = g
            elif grads[old][1] == 1 and old != g:
                unref(g)  # in-place accumulation into the buffered grad
            else:
                s = new_grad(grads[old][0])  # out-of-place sum: a new tensor
                ref(s)
                peak = max(peak, act_live + param_grads + live_grads())
                unref(old)
                unref(g)
                buffers[key] = s
        for g in in_ids:
            unref(g)
        for k in saved[node]:
            refs[k] -= 1
            if refs[k] == 0:
                act_live -= size[k]
        for nxt, _ in out_edges:
            deps[nxt] -= 1
            if deps[nxt] == 0:
                heapq.heappush(ready, (-nxt._sequence_nr(), id(nxt), nxt))
    return peak, act_start


def _fake_like(fake: FakeTensorMode, t: torch.Tensor, device: torch.device, memo: dict) -> torch.Tensor:
    """A FakeTensor of ``t``'s shape and dtype on ``device`` (one per real tensor, so tied
    parameters stay tied)."""
    out = memo.get(id(t))
    if out is None:
        with fake:
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        if isinstance(t, nn.Parameter):
            out = nn.Parameter(out, requires_grad=t.requires_grad)
        memo[id(t)] = out
    return out


def estimate_training_peak(model: torch.nn.Module, example_inputs, optimizer: str = "adamw",
                           adamw_impl: str = "single", device=None) -> TrainingMemory:
    """Estimate the peak bytes of a steady-state step ``zero_grad(); model(*inputs).backward();
    opt.step()`` on one device, without allocating activations.

    ``model`` may live on CPU or on ``meta``; ``model(*example_inputs)`` must return the
    scalar loss. ``device`` is where the step would run (default: the parameters'
    device, or CPU for a meta model): it matters because kernels differ per device and
    save different tensors (on ``meta``, SDPA takes the math path and saves the full
    attention matrix; on CPU and CUDA the flash kernels save only a logsumexp).
    ``adamw_impl`` is ``"single"`` (torch's CPU default) or ``"foreach"`` (its CUDA
    default), see ``cost_models.memory.adamw_step_transient_bytes``."""
    if optimizer not in ("adamw", "adam"):
        raise ValueError(f"only Adam/AdamW is modelled, got optimizer={optimizer!r}")
    if device is None:
        p0 = next(model.parameters(), None)
        device = p0.device if p0 is not None and p0.device.type != "meta" else torch.device("cpu")
    device = torch.device(device)
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    memo: dict = {}
    state = {n: _fake_like(fake, t, device, memo) for n, t in
             list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())}
    inputs = tuple(_fake_like(fake, x, device, memo) if isinstance(x, torch.Tensor) else x
                   for x in example_inputs)

    params = {}
    for p in model.parameters():  # unique parameters
        params[_storage_key(_fake_like(fake, p, device, memo))] = (p.requires_grad, p.numel() * p.element_size())
    param_total = sum(b for _, b in params.values())
    buffer_total = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = [b for rg, b in params.values() if rg]
    input_keys = {_storage_key(x) for x in inputs if isinstance(x, torch.Tensor)}
    input_total = sum(x.numel() * x.element_size() for x in example_inputs if isinstance(x, torch.Tensor))

    rec = _OutputRecorder()
    with fake, torch.enable_grad(), rec:
        loss = torch.func.functional_call(model, state, inputs, tie_weights=True)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None):
        raise ValueError("model(*example_inputs) must return a scalar loss that requires grad "
                         "(pass targets so the zoo models return the loss)")

    excluded = set(params) | input_keys
    bwd_peak, activations = _backward_walk(loss.grad_fn, excluded, {})
    # Forward: all saved activations plus the largest temporary no node keeps. The graph
    # walk told us what is saved; any other op output is transient.
    saved_keys = set()
    stack, seen = [loss.grad_fn], {loss.grad_fn}
    while stack:
        n = stack.pop()
        saved_keys.update(_storage_key(t) for t in _saved_tensors(n))
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    transient = max((b for k, b in rec.outputs if k not in saved_keys and k not in excluded), default=0)
    fwd_peak = activations + transient

    grads = sum(trainable)
    opt_state = 2 * grads + 4 * len(trainable)  # exp_avg + exp_avg_sq + fp32 scalar step
    step_tr = int(adamw_step_transient_bytes(trainable, adamw_impl))
    static = param_total + buffer_total + opt_state + input_total
    peak = training_step_peak(static, fwd_peak, bwd_peak, grads, step_tr)
    phases = {"forward": fwd_peak, "backward": bwd_peak, "optimizer": grads + step_tr}
    return TrainingMemory(params=param_total + buffer_total, grads=grads, optimizer=opt_state,
                          inputs=input_total, activations=activations, forward_peak=fwd_peak,
                          backward_peak=bwd_peak, step_transient=step_tr, peak=int(peak),
                          phase=max(phases, key=phases.get))


def measure_training_peak(model: torch.nn.Module, example_inputs, steps: int = 3, lr: float = 1e-3) -> int:
    """Measured peak bytes over ``steps`` real AdamW training steps, tracked by
    ``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode counting live
    tensor storages; it rounds each storage up to 512 B like the CUDA allocator)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mt = MemTracker()
    mt.track_external(model, opt)
    peak = 0
    dev = next(model.parameters()).device
    with mt:
        for _ in range(steps):
            mt.reset_mod_stats()  # MemTracker refuses a second forward otherwise
            opt.zero_grad(set_to_none=True)
            model(*example_inputs).backward()
            opt.step()
        peak = mt.get_tracker_snapshot("peak")[dev]["Total"]
    return int(peak)
