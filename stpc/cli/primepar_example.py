"""PrimePar's worked example, planned and explained: OPT-175B's fc2 on 8 GPUs (modelled).

PrimePar's paper walks through one operator: OPT-175B's second MLP linear (fc2) on 8 GPUs,
where Megatron-LM's partition {B, N, N} (the batch split over one axis of 2, the contraction
dim N over the other two) becomes PrimePar's {N, P2x2} (N over an axis of 2, its P(2x2)
spatial-temporal partition over an axis of 4). Here both are planned on stpc's cost model
for the same cell the ``primepar`` benchmark plans (``primepar-v100``, fp16, at that cell's
depth): on each mesh shape, the best plan in which every layer's fc2 takes that partition,
everything else re-solved (``plan.solved.best_where``: full effect, as ``plan.explain``
ranks), beside stpc's own plan for the cell and the best P2x2 partition of fc2 that stpc's
space holds on the 2x4 mesh; with fc2's own modelled time (forward, backward and gradient
phases, its ring transfers included) under each. Where no plan with a partition fits the
budget, its row is the best plan ignoring memory, marked, with its peak.
"""
from __future__ import annotations

from stpc.planner import search
from stpc.planner.costs import NodeTimer
from stpc.planner.summary import strategy_label

MODEL, DEVICES, MODULE = "opt-175b", 8, "layers.0.mlp.fc2"


def _megatron(s) -> bool:
    """{B, N, N} on a 2x2x2 mesh: x [b, s, h] split on the batch over axis 0 and on h (N) over
    axes 1 and 2; the output a partial sum over those two."""
    return s.kind == "spatial" and tuple(s.ins[0]) == ("S0", "S2", "S2") and tuple(s.out[1:]) == ("P", "P")


def _primepar(s) -> bool:
    """{N, P2x2} on a 2x4 mesh: h (N) split over axis 0, P(2x2) over the axis of 4."""
    return s.kind == "p2x2" and s.axis == 1 and s.ins[0][0] == "S2"


def _any_p2x2(s) -> bool:
    return s.kind == "p2x2"


CANDIDATES = (("2x2x2", "Megatron's {B, N, N}", _megatron),
              ("2x4", "PrimePar's {N, P2x2}", _primepar),
              ("2x4", "the best P2x2 partition stpc's space holds", _any_p2x2))


def _fc2(plan) -> str:
    names = [k for k, n in plan.nodes.items() if n.module == MODULE and n.op == "linear.default"]
    if not names:
        raise LookupError(f"no linear of module {MODULE!r} in the {MODEL} plan")
    return names[0]


def _row(plan, what: str, accept) -> dict:
    sv = plan.solved
    name = _fc2(plan)
    g = sv.group_of(name)[1]
    alt = sv.best_where(g, accept)
    row = {"mesh": "x".join(map(str, plan.mesh_shape)), "partition": what, "node": name}
    if alt is None:
        if not any(accept(s) for s in sv.b.groups[g].strategies):
            row["missing"] = "not in stpc's strategy space"
            return row
        # no plan with it fits the budget: the best ignoring memory, with its peak
        alt = sv.best_where(g, accept, exact_budget=False)
        row["over_budget"] = True
    s = sv.b.groups[g].strategies[alt.choice]
    node = next(n for n in sv.b.graph.nodes if n.name == name)
    timer = NodeTimer(node, sv.b.cm, [True, True])  # (the cost model the plan was solved on)
    row.update(strategy=strategy_label(s), fc2_s=timer(s), step_s=alt.step_s, peak_bytes=alt.peak_bytes,
               how=alt.how)
    return row


def worked_example(traces, target, budget: float, layers: int, optimizer_layout: str) -> dict:
    """Plan the example at ``layers`` deep on ``target`` (a ``bench_primepar.Target``), as its
    cell is planned (the same budget and optimizer layout)."""
    tg = traces.get(MODEL, layers, target.dtype)
    kw = dict(cluster=target.cluster, budget_bytes=budget, dtype=target.dtype, optimizer_layout=optimizer_layout)
    own = search(tg, DEVICES, **kw)
    name = _fc2(own)
    chosen = own.nodes[name]
    rows = [{"mesh": "x".join(map(str, own.mesh_shape)), "partition": "stpc's own plan for the cell",
             "node": name, "strategy": strategy_label(chosen), "step_s": own.modelled_step_time_s,
             "peak_bytes": own.peak_memory_bytes, "how": "chosen",
             "fc2_s": _row(own, "", lambda s: strategy_label(s) == strategy_label(chosen)).get("fc2_s")}]
    by_mesh = {}
    for mesh, what, accept in CANDIDATES:
        if mesh not in by_mesh:
            by_mesh[mesh] = search(tg, mesh, **kw)
        rows.append(_row(by_mesh[mesh], what, accept))
    return {"model": MODEL, "devices": DEVICES, "layers": layers, "cluster": target.cluster.name,
            "dtype": target.dtype, "rows": rows}


def section(ex: dict) -> list[str]:
    """The example's lines for the primepar section."""
    gib = 2**30
    lines = [f"### PrimePar's worked example: {ex['model']}'s fc2 on {ex['devices']} devices "
             f"({ex['cluster']}, {ex['dtype']}, {ex['layers']} layers)", "",
             "Each row: the best plan (modelled) in which every layer's fc2 takes the partition named, everything "
             "else re-solved on that mesh shape; fc2's own modelled time under it (forward + backward + gradient, "
             "ring transfers included). PrimePar's paper has Megatron's {B, N, N} become {N, P2x2} for this "
             "operator.", "",
             "| mesh | fc2 partition | strategy | fc2 s (modelled) | step s (modelled) | peak GiB |",
             "|---|---|---|---|---|---|"]
    for r in ex["rows"]:
        if "missing" in r:
            lines.append(f"| {r['mesh']} | {r['partition']} | {r['missing']} | - | - | - |")
            continue
        over = " (over the budget: no plan with it fits; the best ignoring memory)" if r.get("over_budget") else ""
        lines.append(f"| {r['mesh']} | {r['partition']}{over} | `{r['strategy']}` | {r['fc2_s']:.4f} | "
                     f"{r['step_s']:.4f} | {r['peak_bytes'] / gib:.1f} |")
    own, meg = ex["rows"][0], ex["rows"][1]
    pp = next((r for r in ex["rows"][2:] if "missing" not in r), None)
    if "missing" not in meg and pp is not None:
        budget = (f", though no plan with it fits the budget (the fastest, ignoring memory, peaks at "
                  f"{pp['peak_bytes'] / gib:.1f} GiB)"
                  if pp.get("over_budget") else "")
        lines += ["", f"Under the model, {pp['partition']} on {pp['mesh']} gives a step "
                      f"{meg['step_s'] / pp['step_s']:.3f}x as fast as Megatron's {{B, N, N}} "
                      f"(fc2 alone {meg['fc2_s'] / pp['fc2_s']:.3f}x){budget}; stpc's own plan for the cell, "
                      f"{meg['step_s'] / own['step_s']:.3f}x."]
    return lines


__all__ = ["worked_example", "section", "CANDIDATES"]
