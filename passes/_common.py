"""Helpers the passes share: placements on nodes, local FakeTensor values, errors.

Metadata the passes keep on every tensor-valued node once ``shard_params`` /
``insert_collectives`` have run:

  meta["val"]         FakeTensor of the LOCAL (per-rank) value
  meta["global_val"]  FakeTensor of the full value (what stpc.trace recorded)
  meta["placement"]   tuple of tokens, one per mesh axis (stpc.placement)
  meta["comm"]        on communication nodes only: {"op", "axis", ...} (see verify)
  meta["stpc_taps"]   which submodule calls took or returned this value (stpc.frontend.module_calls);
                      a pass that replaces a node by another holding the same value carries it over
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from stpc.frontend.annotate import source_of
from stpc.frontend.module_calls import TAPS
from stpc.placement import local_shape


class LoweringError(RuntimeError):
    """A node the passes cannot lower; the message names the node, its source line and the fix."""


def where(node: fx.Node) -> str:
    src = node.meta.get("source") or ""
    if not src:
        src = source_of(node)
    return f"node {node.name} ({node.op} {getattr(node.target, '__name__', node.target)}" \
           f"{', at ' + src if src else ''})"


def fail(node: fx.Node, what: str, fix: str) -> LoweringError:
    return LoweringError(f"stpc: cannot lower {where(node)}: {what}. Fix: {fix}")


def fake_mode_of(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake(mode, shape, dtype, device) -> torch.Tensor:
    with mode:
        return torch.empty(tuple(shape), dtype=dtype, device=device)


def mesh_of(plan) -> tuple[int, ...]:
    return tuple(int(n) for n in plan.mesh_shape)


def default_groups(mesh) -> list[str]:
    """Stand-in group names for graphs that are built but not run (tests, dumps)."""
    return [f"mesh_axis{a}" for a in range(len(mesh))]


def set_local(node: fx.Node, placement, mesh, mode, device, global_val=None) -> None:
    """Record ``placement`` on ``node`` and make meta["val"] the local FakeTensor."""
    g = global_val if global_val is not None else node.meta.get("global_val", node.meta.get("val"))
    if g.device != torch.device(device):  # the full value as it is on the run's device (the trace may be on meta)
        g = fake(mode, tuple(g.shape), g.dtype, device)
    node.meta["global_val"] = g
    node.meta["placement"] = tuple(placement)
    node.meta["val"] = fake(mode, local_shape(tuple(g.shape), tuple(placement), mesh), g.dtype, device)


def n_of(mesh, axes) -> int:
    return math.prod(mesh[a] for a in axes)


def is_random(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers (moved or assumed alike on every rank, it would not be)."""
    return torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


def is_tensor_node(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)


def carry_taps(new: fx.Node, *old: fx.Node) -> None:
    """``new`` now holds the value the traced program computed at ``old`` (in ``new``'s own
    placement), while ``old`` is gone or holds something else (a partial piece of it): the
    module-call tags move to ``new``."""
    for o in old:
        if o.meta.get(TAPS):
            new.meta.setdefault(TAPS, []).extend(o.meta.pop(TAPS))


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm
