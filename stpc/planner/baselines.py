"""baselines: the layout space of each preset stpc is compared with, searched whole.

A baseline is the best plan of its own space, under the same cost model and memory
budget as stpc's own search: ``search`` solves every layout of the space exactly
(or proves it cannot win) and keeps the fastest, as it does with mesh shapes.

* ``megatron`` — Megatron-LM: tensor + sequence parallelism (TP) on one mesh axis,
  data parallelism (DP) on the other; every factorisation dp x tp = N (pure DP and
  pure TP included), both axis orders (``dp-outer``: DP across nodes, TP inside one,
  the usual choice; ``tp-outer``: the reverse) and the distributed optimizer on or
  off. Megatron's distributed optimizer is ZeRO-1 (reduce-scatter the gradients, step
  1/dp of the state, all-gather the weights: DP's all-reduce traffic); stpc plans and runs
  it as ZeRO-2, the same traffic in no more memory: weights, gradients and optimizer state
  stored 1/dp per rank, each weight gathered once per step and kept for backward
  (``Hints.keep_gathered``).
* ``fsdp-tp`` — TorchTitan's 2-D default: FSDP (ZeRO-3) over DP, TP+SP over the other
  axis; every factorisation with dp >= 2 (pure FSDP included), both orders. The
  parameter all-gathers and gradient reduce-scatters overlap compute as FSDP's
  prefetch does (``cost_models.overlap``, the same rule for every plan). The gathered
  weights are freed after forward and gathered again in backward (FSDP2's default,
  ``reshard_after_forward=True``, what stpc's runtime does with a ZeRO-3 weight).
* ``spatial`` — stpc's own search with the spatial-temporal families off (Alpa-like):
  every mesh shape ``search.mesh_shapes`` tries, each with sharded weights regathered in
  backward or kept from forward (:func:`own_points`, as stpc's own search).

Activation recomputation joins every space alike, baselines included: a point whose plan
does not fit the budget is searched again with its first layers recomputed, selectively
and in full (``search`` module docstring), and the layout says so (:func:`describe_layout`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from stpc.planner.hints import Hints, fsdp_tp, megatron, spatial

BASELINES = ("megatron", "fsdp-tp", "spatial")


@dataclass(frozen=True)
class Layout:
    """How a Megatron/FSDP baseline uses N devices: the DP and TP degrees, which of the two
    axes is outer (row-major: the outer axis strides across nodes first), and what ZeRO
    shards over DP (0: nothing; 1: Megatron's distributed optimizer, run as ZeRO-2:
    everything sharded at rest, weights gathered once per step; 3: FSDP, weights gathered
    again in backward)."""

    dp: int
    tp: int
    order: str = "dp-outer"   # "dp-outer" | "tp-outer"; "-" when one degree is 1
    zero: int = 0
    sp: bool = False          # sequence parallelism always (else the solver's choice per op)

    def _outer_first(self) -> list[tuple[str, int]]:
        return [("tp", self.tp), ("dp", self.dp)] if self.order == "tp-outer" else [("dp", self.dp), ("tp", self.tp)]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self._outer_first() if n > 1) or (1,)

    def axes(self) -> tuple[int | None, int | None]:
        """(DP axis, TP axis) in ``mesh_shape``; None for a degree of 1."""
        kept = [name for name, n in self._outer_first() if n > 1]
        return (kept.index("dp") if "dp" in kept else None), (kept.index("tp") if "tp" in kept else None)

    def as_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "order": self.order, "zero": self.zero, **({"sp": True} if self.sp else {})}

    def describe(self) -> str:
        where = {"dp-outer": ", dp-outer (TP on the inner axis)", "tp-outer": ", tp-outer (DP on the inner axis)"}
        zero = {0: "", 1: ", distributed optimizer (run as ZeRO-2)", 3: ", ZeRO-3 (FSDP)"}[self.zero]
        sp = ", sequence parallel" if self.sp else ""
        return f"dp {self.dp} x tp {self.tp}{where.get(self.order, '')}{zero}{sp}"


def layouts(name: str, n: int, mesh_shape: tuple[int, ...] | None = None) -> list[Layout]:
    """Every layout of baseline ``name`` on ``n`` devices (only those whose mesh is
    ``mesh_shape``, if given), in a fixed order: DP degree descending, DP outer before
    TP outer, ZeRO-1 before none (so a tie in time goes to the smaller memory)."""
    out = []
    for dp in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
        tp = n // dp
        orders = ["dp-outer", "tp-outer"] if dp > 1 and tp > 1 else ["-"]
        if name == "megatron":
            zeros = [1, 0] if dp > 1 else [0]
        elif name == "fsdp-tp":
            zeros = [3] if dp > 1 else []
        else:
            raise ValueError(f"no layout space for {name!r}; known: megatron, fsdp-tp")
        out += [Layout(dp, tp, o, z) for o in orders for z in zeros]
    return [lay for lay in out if mesh_shape is None or lay.mesh_shape == tuple(mesh_shape)]


def layout_hints(name: str, layout: Layout) -> Hints:
    dp, tp = layout.axes()
    if name == "megatron":
        return megatron(layout.mesh_shape, dp, tp, distributed_optimizer=layout.zero == 1, sequence_parallel=layout.sp)
    return fsdp_tp(layout.mesh_shape, dp, tp, sequence_parallel=layout.sp)


def first_layers(k: int | None) -> str:
    """The layers ``Hints.recompute_layers`` = k names, in words (None: every layer)."""
    return "layers" if k is None else "the first layer" if k == 1 else f"the first {k} layers"


def describe_layout(layout: dict | None) -> str:
    """One line for a plan's layout record (``plan.stats["layout"]``)."""
    if not layout:
        return ""
    if layout.get("recompute"):
        rest = {k: v for k, v in layout.items() if k not in ("recompute", "recompute_layers")}
        which = first_layers(layout.get("recompute_layers"))
        return describe_layout(rest) + {"selective": f", {which} recomputed in backward but for their matmuls"}.get(
            layout["recompute"], f", {which} recomputed in backward")
    if "dp" in layout:
        return Layout(**layout).describe()
    kept = layout.get("kept")
    over = (f" over mesh axis {kept[0]}" if isinstance(kept, list) and len(kept) == 1
            and len(layout["mesh"].split("x")) > 1 else "")
    return (f"mesh {layout['mesh']}" + ("" if layout.get("temporal", True) else ", spatial families only")
            + (f", sharded weights gathered once and kept for backward (ZeRO-2){over}" if kept else ""))


def kept_variants(ndim: int) -> list[tuple[int, ...]]:
    """The sets of mesh axes over which a point of stpc's own space keeps gathered weights
    (``Hints.keep_gathered``): none, each axis alone, and every axis. One axis alone is what
    Megatron's distributed optimizer keeps over (its DP axis) while TP splits weights on the
    other: keeping over every axis charges a TP-split weight a whole kept copy
    (``costs.kept_gathered_bytes`` goes by the placement alone)."""
    out = [()] + [(a,) for a in range(ndim)]
    return out + [tuple(range(ndim))] if ndim > 1 else out


def own_points(shapes: list[tuple[int, ...]], hints: Hints, record: dict | None = None):
    """(mesh shape, hints, layout record) of stpc's own space (and ``spatial``'s): every mesh
    shape, each with the ways to run a weight stored sharded and read whole: gathered in
    forward and again in backward (ZeRO-3, FSDP's default) or gathered once and kept for
    backward (ZeRO-2) over the axes of each of :func:`kept_variants` (``"kept"``: those
    axes). Without them, a plan the ``megatron`` baseline reaches (its distributed
    optimizer runs as ZeRO-2 over its DP axis) would be outside stpc's own space."""
    out = []
    for s in shapes:
        rec = {"mesh": "x".join(map(str, s)), **(record or {})}
        for kept in kept_variants(len(s)):
            if kept:
                out.append((s, replace(hints, keep_gathered=kept), {**rec, "kept": list(kept)}))
            else:
                out.append((s, hints, rec))
    return out


def candidates(name: str, n: int, mesh_shape: tuple[int, ...] | None, shapes: list[tuple[int, ...]]):
    """(mesh shape, hints, layout record) of every point of baseline ``name``'s space;
    ``shapes``: the mesh shapes stpc's own search tries (the ``spatial`` space, with both
    ways of running a sharded weight, as stpc's own: :func:`own_points`)."""
    if name == "spatial":
        return own_points(shapes, spatial(()), {"temporal": False})
    return [(lay.mesh_shape, layout_hints(name, lay), lay.as_dict()) for lay in layouts(name, n, mesh_shape)]


__all__ = ["BASELINES", "Layout", "layouts", "layout_hints", "candidates", "own_points", "kept_variants", "describe_layout"]
