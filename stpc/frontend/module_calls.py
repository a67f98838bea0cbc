"""module_calls: which graph values each submodule call took and returned.

A compiled model runs one flat program, so its submodules are never called and their
forward hooks could not fire. To let them fire anyway, the trace remembers every
submodule call: while ``torch.export`` runs the model, a recorder on each submodule tags
the node that holds each tensor the call receives (its ``(args, kwargs)`` leaves) and
returns (its output's leaves) with ``node.meta["stpc_taps"]`` entries
``(call id, "in" | "out", leaf index)``. The tags ride on the nodes through the passes
(a pass that replaces a node carries them to the node holding the same value), so the
runtime finds each value in the final program and hands it to the hooks
(``stpc.passes.tap_hooks``, ``stpc.runtime.hook_taps``).

The user's own submodule hooks are set aside while tracing: they would otherwise run on
fake tensors and keep them.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.experimental import proxy_tensor

__all__ = ["ModuleCall", "recording", "TAPS"]

TAPS = "stpc_taps"  # node.meta key: [(call id, "in" | "out", leaf index), ...]
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


@dataclass
class ModuleCall:
    """One call of a submodule in the traced forward.

    ``inputs`` / ``outputs`` hold one entry per pytree leaf of ``(args, kwargs)`` / of the
    output: ``("tensor", None)`` for a tensor (its node carries the tag), ``("const", v)``
    for anything else, ``("unknown", why)`` for a tensor no node holds (the call's hooks
    cannot fire, and say so).
    """

    id: int
    fqn: str
    in_spec: object
    inputs: list
    out_spec: object = None
    outputs: list | None = None   # None: the call never returned (its forward raised)
    enter: int = 0                # when the call started and returned, in one count of both over
    exit: int = -1                # the forward: its hooks fire in this order, as in eager mode


def _leaves(tree, call_id: int, role: str) -> tuple[list, object]:
    flat, spec = pytree.tree_flatten(tree)
    mode = proxy_tensor.get_proxy_mode()
    out = []
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            out.append(("const", x))
            continue
        try:
            node: fx.Node = proxy_tensor.get_proxy_slot(x, mode.tracer).proxy.node
        except Exception as e:  # a tensor the tracer does not follow (no node holds it)
            out.append(("unknown", f"{type(e).__name__}: no graph node holds this tensor"))
            continue
        node.meta.setdefault(TAPS, []).append((call_id, role, i))
        out.append(("tensor", None))
    return out, spec


@contextlib.contextmanager
def recording(model: nn.Module):
    """Record every submodule call of ``model`` during a trace; yields the list it fills.

    The root module's hooks stay (they run on the caller's side of the program); every
    submodule's forward hooks are set aside and put back on exit, the same dict objects,
    so the user's ``RemovableHandle`` s keep working.
    """
    calls: list[ModuleCall] = []
    saved = []
    handles = []
    open_calls: dict[int, list[ModuleCall]] = {}  # id(module) -> its calls not yet returned
    clock = iter(range(1 << 62))
    for fqn, mod in model.named_modules():
        if not fqn:
            continue
        saved.append((mod, {k: getattr(mod, k) for k in _HOOK_DICTS}))
        for k in _HOOK_DICTS:
            setattr(mod, k, OrderedDict())

        def pre(m, args, kwargs, fqn=fqn):
            if proxy_tensor.get_proxy_mode() is None:  # not under export's tracer: nothing to tag
                return None
            call = ModuleCall(len(calls), fqn, None, [], enter=next(clock))
            call.inputs, call.in_spec = _leaves((tuple(args), dict(kwargs)), call.id, "in")
            calls.append(call)
            open_calls.setdefault(id(m), []).append(call)
            return None

        def post(m, args, output):
            pending = open_calls.get(id(m))
            if not pending:
                return None
            call = pending.pop()
            call.exit = next(clock)
            call.outputs, call.out_spec = _leaves(output, call.id, "out")
            return None

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
        for mod, dicts in saved:
            for k, d in dicts.items():
                setattr(mod, k, d)
