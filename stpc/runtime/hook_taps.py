"""hook_taps: the forward hooks of a compiled model's submodules, fired from its program.

The program replaces every submodule call, so nothing would call their hooks. Instead the
program hands each value a hooked call took or returned to :func:`hook_record` right
after computing it (``stpc.passes.tap_hooks`` puts the calls in); :class:`HookTaps` wraps
the rank's piece as a ``DTensor`` of the value's placement and, once a call's inputs (then
its outputs) are all in, calls the module's forward pre-hooks (then forward hooks) as
``nn.Module.__call__`` would: ``hook(module, args[, kwargs][, output])``, ``args``,
``kwargs`` and ``output`` rebuilt in the call's own structure.

Hooks observe: the tensors they get are detached DTensors (``.full_tensor()`` gathers
one; every rank runs the same hooks, so it is a collective like any other). A hook that
returns a value would change the program's computation, which is fixed when it is
compiled: :class:`UnsupportedHook` says so, naming the module. A grid-layout value
(PrimePar blocks, which no DTensor placement says) is gathered whole first.
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from stpc.placement import is_grid
from stpc.runtime.dtensors import dtensor_placements
from stpc.runtime.reshard import unshard_tensor

__all__ = ["HookTaps", "UnsupportedHook", "hook_record"]

_LIVE: weakref.WeakValueDictionary[int, HookTaps] = weakref.WeakValueDictionary()  # key -> taps a program feeds
_KEYS = itertools.count()


class UnsupportedHook(RuntimeError):
    """A submodule hook stpc cannot run as asked (it returns a value, or the plan never
    computes what it would see)."""


@torch.compiler.disable
def hook_record(taps: int, slot: int, x: Tensor) -> None:
    """Called by the program: ``x`` is this rank's piece of tap slot ``slot``."""
    _LIVE[taps].record(slot, x)


class HookTaps:
    """The taps of one program variant: ``calls`` (``stpc.frontend.module_calls.ModuleCall``),
    and after :meth:`attach`, per slot the tags ``(call id, "in" | "out", leaf)`` its node
    carries, its placement and global shape."""

    def __init__(self, calls: list, mesh, groups: list[str]):
        self.key = next(_KEYS)
        _LIVE[self.key] = self
        self.calls = {c.id: c for c in calls}
        self.mesh = mesh
        self.groups = groups
        self.slots: list = []
        self.root: nn.Module | None = None

    def attach(self, slots: list, wanted: set[int]) -> None:
        self.slots = slots
        self.wanted = sorted(wanted)

    def begin(self, root: nn.Module) -> None:
        """Start a call of the program on ``root`` (the compiled model)."""
        self.root = root
        self.values = {cid: ({}, {}) for cid in self.wanted}
        self.fired = {cid: set() for cid in self.wanted}

    def end(self) -> None:
        """The program returned: calls with no tensor to wait for fire now."""
        self._fire_ready(self.wanted)
        self.root = None

    def record(self, slot: int, x: Tensor) -> None:
        tags, placement, shape = self.slots[slot]
        value = self._wrap(x, placement, shape)
        for cid, role, leaf in tags:
            if cid in self.values:
                self.values[cid][role == "out"][leaf] = value
        self._fire_ready({t[0] for t in tags if t[0] in self.values})

    # ------------------------------------------------------------------ internals
    def _wrap(self, x: Tensor, placement, shape) -> DTensor:
        x = x.detach()
        if any(is_grid(t) for t in placement):
            full = unshard_tensor(x, placement, self.groups)
            return DTensor.from_local(full, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return DTensor.from_local(x, self.mesh, dtensor_placements(placement, ()), run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    def _tree(self, entries: list, got: dict, spec):
        leaves = [got[i] if kind == "tensor" else value for i, (kind, value) in enumerate(entries)]
        return pytree.tree_unflatten(leaves, spec)

    def _fire_ready(self, cids) -> None:
        """Fire every hook event of ``cids`` whose values are all in, in eager order (a call's
        pre-hooks at its start, its hooks at its return; an inner call returns first)."""
        while True:
            ready = []
            for cid in cids:
                call, (ins, outs), fired = self.calls[cid], self.values[cid], self.fired[cid]
                if "pre" not in fired and len(ins) == _n_tensors(call.inputs):
                    ready.append((call.enter, "pre", cid))
                elif ("pre" in fired and "post" not in fired and call.outputs is not None
                      and len(outs) == _n_tensors(call.outputs)):
                    ready.append((call.exit, "post", cid))
            if not ready:
                return
            _, event, cid = min(ready)
            self.fired[cid].add(event)
            self._fire(event, self.calls[cid])

    def _fire(self, event: str, call) -> None:
        module = self.root.get_submodule(call.fqn)
        ins, outs = self.values[call.id]
        args, kwargs = self._tree(call.inputs, ins, call.in_spec)
        if event == "pre":
            for hid, hook in list(module._forward_pre_hooks.items()):
                res = hook(module, args, kwargs) if hid in module._forward_pre_hooks_with_kwargs else \
                    hook(module, args)
                self._refuse(res, call, "forward pre-hook", hook)
            return
        output = self._tree(call.outputs, outs, call.out_spec)
        for hid, hook in list(module._forward_hooks.items()):
            res = hook(module, args, kwargs, output) if hid in module._forward_hooks_with_kwargs else \
                hook(module, args, output)
            self._refuse(res, call, "forward hook", hook)

    @staticmethod
    def _refuse(res, call, what: str, hook) -> None:
        if res is not None:
            name = getattr(hook, "__qualname__", repr(hook))
            raise UnsupportedHook(
                f"stpc: the {what} {name} on submodule {call.fqn!r} returned a value: a compiled model's "
                f"computation is fixed when stpc.compile traces it, so a hook can observe a submodule's "
                f"values but not replace them. Fix: make the change in the module's forward (then "
                f"stpc.compile), or return None from the hook")


def _n_tensors(leaves: list) -> int:
    return sum(kind == "tensor" for kind, _ in leaves)
