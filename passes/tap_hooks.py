"""tap_hooks: a copy of a lowered program that hands hooked submodule calls their values.

Not part of the planning pipeline: the compiled model runs it on its finished program
when some submodule has forward hooks (``stpc.runtime.hook_taps`` says what the hooks
get). Every node tagged by the trace as taking part in a hooked call
(``meta["stpc_taps"]``, kept on the node that holds the value by every pass) gets a
``runtime.hook_record(taps, slot, node)`` call right after it — after the last
placeholder for an input — so each hook fires as soon as its values exist. The copy
computes exactly what the original does; the record calls have no users.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from stpc.frontend.module_calls import TAPS
from stpc.runtime.hook_taps import UnsupportedHook, hook_record
from ._common import finish


def tap_hooks(gm: fx.GraphModule, calls: list, hooked: Callable[[str], bool], taps: int
              ) -> tuple[fx.GraphModule, list, set[int]]:
    """``(tapped copy, slots, wanted call ids)`` for the calls of the submodules ``hooked``
    accepts (by FQN); ``slots[i]`` is ``(tags, placement, global shape)`` of the value
    ``hook_record(taps, i, ...)`` receives. Raises :class:`UnsupportedHook` naming the
    module when the program never holds a value one of its calls took or returned."""
    wanted = {c.id for c in calls if hooked(c.fqn)}
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    last_placeholder = None
    for n in graph.nodes:
        if n.op == "placeholder":
            last_placeholder = n
    slots, found = [], set()
    for n in list(graph.nodes):
        tags = [t for t in n.meta.get(TAPS, ()) if t[0] in wanted]
        if not tags or "placement" not in n.meta:
            continue
        slot = len(slots)
        slots.append((tags, tuple(n.meta["placement"]), tuple(n.meta["global_val"].shape)))
        found.update(tags)
        with graph.inserting_after(last_placeholder if n.op == "placeholder" else n):
            graph.call_function(hook_record, (taps, slot, n))
    for c in calls:
        if c.id not in wanted:
            continue
        for role, leaves in (("in", c.inputs), ("out", c.outputs or [])):
            for i, (kind, why) in enumerate(leaves):
                if kind == "unknown" or (kind == "tensor" and (c.id, role, i) not in found):
                    what = "an input" if role == "in" else "an output"
                    raise UnsupportedHook(
                        f"stpc: the forward hooks on submodule {c.fqn!r} cannot fire: {what} of its call "
                        f"(leaf {i}) {'was not traced (' + why + ')' if kind == 'unknown' else 'is never computed as such by the program under this plan'}. "
                        f"Fix: hook a module whose inputs and outputs are plain tensors the forward computes, "
                        f"or remove the hook")
    tapped = fx.GraphModule(gm, graph)
    tapped.meta.update(gm.meta)
    return finish(tapped), slots, wanted


__all__ = ["tap_hooks"]
