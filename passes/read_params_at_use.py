"""read_params_at_use: a parameter's local tensor is read where the program first uses it.

Expects: a finished eager program (after ``verify``). Its parameter placeholders are then
given the parameters themselves (``Program.feed``'s ``"param_ref"`` entries), not their
local tensors.

Why: a DTensor parameter reaches the program's local arithmetic through an autograd node
(``runtime.read_param``: ``param_local``'s), and autograd's engine runs the nodes that are
ready newest first (by creation order). Read all together at the start of the step, those
nodes are the oldest of the graph, so backward runs every one of them last, after all of
backward's compute: each gradient reaches its parameter — and the bucketed reducer's hooks,
which launch the data-parallel all-reduces — only at the end, and the reduction never
overlaps backward (a plain leaf's accumulation runs first of all ready nodes; a parameter
read where used, as a module's ``to_local`` in TorchTitan's TP is, is created with its
consumer, so backward runs it as soon as its gradient is complete).

What it does: for each parameter placeholder (``meta["param"]``) whose placement holds no
grid layout (those are laid out by a P2P exchange as they are fed, ``to_plan_layout``),
with users, one ``runtime.read_param`` node right before its first user in graph order,
which every user then reads (one read, so autograd sums a tied parameter's uses before its
one gradient, as before). The read carries the placeholder's metadata (its local value, its
placement, its submodule taps); the placeholder is marked ``meta["read_at_use"]``.

Guarantees: the same values and gradients, the same communication in the same order; a
program run under ``torch.compile`` is not given this pass (its backward is one compiled node).
"""
from __future__ import annotations

import torch.fx as fx

from ._common import finish
from stpc import runtime
from stpc.frontend.module_calls import TAPS
from stpc.placement import is_grid


def read_params_at_use(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Move each parameter's read to right before its first use; see the module docstring."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        if not ph.meta.get("param") or not ph.users or any(is_grid(t) for t in ph.meta.get("placement", ())):
            continue
        first = min(ph.users, key=order.__getitem__)
        with gm.graph.inserting_before(first):
            read = gm.graph.call_function(runtime.read_param, (ph,))
        read.meta.update({k: v for k, v in ph.meta.items() if k != "param"})
        ph.meta.pop(TAPS, None)  # (its value is the read's now)
        ph.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
        ph.meta["read_at_use"] = True
    return finish(gm)
