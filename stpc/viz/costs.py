"""Per-layer cost of a plan: compute / exposed communication / hidden communication per
distinct layer, the plan's step-time split (``plan.summary()``, ``plan.stats["breakdown"]``)
attributed to the layers it comes from, and a bar chart of two plans side by side.

The split is ``stpc.planner.summary.breakdown``'s, item by item instead of summed:

* compute: every op's local work with transfers free (the same ``_FreeComm`` cost model),
  and each parameter's optimizer step;
* exposed: what transfers add to the step: ring transfers longer than their step's
  compute, gathers of followers that cannot keep a layout, reshards on the edges into an
  op (charged to the consuming op) and on shared reads (charged to the first consumer),
  parameter synchronisation beyond the consuming op's compute (with the slowdown beside it);
* hidden: ring transfers under their step's matmul, parameter synchronisation under its
  op's compute (not in the step time).

A layer is the prefix of a module path up to its number (``layers.3``); tied layers are one
bar (their costs added up: every bar is time per step, all copies), ops outside the stack
one bar before and one after it. The bars add up to the plan's totals. It needs the solved
problem (a plan planned in this process): a plan loaded from disk keeps the totals only.
"""
from __future__ import annotations

import numpy as np
from matplotlib.patches import Patch

from stpc.cost_models import CostModel
from stpc.planner.costs import NodeTimer
from stpc.planner.strategies import tensor_operands
from stpc.planner.summary import _FreeComm, _FreeCompute, layer_key  # the breakdown's own cost models
from stpc.viz._figure import COLORS, new_figure, save, unit

NS = 1e9  # the Problem's unit (integer nanoseconds)


def _blocks_of(plan) -> tuple[dict, dict]:
    """(node name -> block key, block key -> label) in graph order. A node's block is the
    layer of its tie representative; nodes outside the repeated layers are ``before`` or
    ``after`` them."""
    layer = {name: layer_key(n.module)[0] for name, n in plan.nodes.items()}
    seen_layer, block, copies, tops = False, {}, {}, {}
    for name, n in plan.nodes.items():
        rep = n.tied_to if n.tied_to in plan.nodes else name
        key = layer[rep] or layer[name]
        if key:
            seen_layer = True
            copies.setdefault(key, [])
            if layer[name] not in copies[key]:
                copies[key].append(layer[name])
        else:
            key = "after" if seen_layer else "before"
            top = (n.module or "").split(".")[0]
            if top and n.role in ("decision", "follower"):
                tops.setdefault(key, [])
                if top not in tops[key]:
                    tops[key].append(top)
        block[name] = key
    labels = {}
    for key in dict.fromkeys(block.values()):
        if key in ("before", "after"):
            names = tops.get(key, [])
            labels[key] = f"{key} the layers" + (f":\n{', '.join(names[:3])}" if names else "")
            continue
        ls = copies[key]
        if len(ls) == 1:
            labels[key] = key
        else:
            last = ls[-1].rsplit(".", 1)[-1]
            labels[key] = f"{ls[0]}-{last}\n(x{len(ls)}, tied)"
    return block, labels


def layer_costs(plan) -> list[dict]:
    """Per distinct layer, in graph order: ``{"block", "label", "compute_s", "exposed_s",
    "hidden_s"}`` (modelled seconds per step, all tied copies). Summed over the layers they
    are ``plan.stats["breakdown"]``'s ``compute_s``, ``exposed_s`` (compute + exposed = the
    step time) and ``hidden_s``. Needs ``plan.solved`` (a plan planned in this process)."""
    sv = plan.solved
    if sv is None:
        raise ValueError("per-layer costs need the solved problem, which a plan loaded from disk does not keep: "
                         "re-plan the model (stpc.search / python -m stpc plan) in this process")
    b, p, ch = sv.b, sv.problem, sv.choice
    cm, facts = b.cm, b.facts
    block, labels = _blocks_of(plan)
    rows = {k: {"block": k, "label": labels[k], "compute_s": 0.0, "exposed_s": 0.0, "hidden_s": 0.0}
            for k in labels}

    def add(node_name: str, part: str, seconds: float):
        rows[block[node_name]][part] += seconds

    free = type(b)(b.tg, _FreeComm(cm.cluster, cm.mesh_shape, cm.overlap_slowdown), b.hints, b.memory, facts)
    free.build(None, edges=False)
    transfers = _FreeCompute(cm.cluster, cm.mesh_shape, cm.overlap_slowdown)
    for it in facts.items:  # each item's nodes are tied copies of it.node: one block
        c = ch[it.group]
        if it.kind == "decision":
            real, comp = b.groups[it.group].own_cost[c], free.groups[it.group].own_cost[c]
            s = b.groups[it.group].strategies[c]
            if s.kind not in ("spatial", "replicate-fallback"):  # a ring: sum max(compute, transfer)
                t = NodeTimer(it.node, transfers, [o in b.rg for o in tensor_operands(it.node)])(s)
                add(it.node.name, "hidden_s", max(0.0, comp + t - real) * it.count)  # (as summary.breakdown)
        elif it.kind in ("follower", "derived"):
            real, comp = float(b.extra[it][c]), float(free.extra[it][c])
        elif it.kind == "param":  # its optimizer step (memory-bound work) and a skewed weight's relayout
            real, comp = float(b.groups[it.group].own_cost[c]), float(free.groups[it.group].own_cost[c])
        else:
            continue
        add(it.node.name, "compute_s", comp * it.count)
        add(it.node.name, "exposed_s", (real - comp) * it.count)

    # edges: charged to the consumer; parameter edges also hide part of their transfer
    def edge_seconds(problem) -> dict:
        out: dict = {}
        for e in problem.edges:
            key = (e.v, sv.b.facts.group_items[e.u].kind == "param")
            out[key] = out.get(key, 0.0) + e.table.get((e.ucls[ch[e.u]], e.vcls[ch[e.v]]), 0) / NS
        return out

    real = edge_seconds(p)
    s1 = cm.overlap_slowdown
    s2 = 1.0 if s1 < 1.0 else 0.0  # exposed(s) = comm - (1 - s) * hidden: two slowdowns give hidden
    other = type(b)(b.tg, CostModel(cm.cluster, cm.mesh_shape, s2), b.hints, b.memory, facts).build(None)
    alt = edge_seconds(other)
    for (v, is_param), seconds in real.items():
        name = facts.group_items[v].node.name
        add(name, "exposed_s", seconds)
        if is_param:
            add(name, "hidden_s", (alt.get((v, True), 0.0) - seconds) / (s2 - s1))
    for s in p.shares:  # a reshard several consumers read, paid once: the first consumer's
        add(facts.group_items[s.vs[0]].node.name, "exposed_s", s.value(ch) / NS)
    return [r for r in rows.values() if any(r[k] for k in ("compute_s", "exposed_s", "hidden_s"))]


def layers(plan, baseline=None, out=None, names: tuple[str, str] | None = None):
    """Bar chart of ``layer_costs``: per distinct layer, ``plan`` (and ``baseline``, e.g. the
    megatron preset's plan of the same model, beside it): compute and exposed communication
    stacked (their sum is the layer's share of the step time), hidden communication hatched
    above them (it runs under compute: not in the step time). Returns the Figure; saves it to
    ``out`` when given. ``names`` labels the two plans (default: their hints, else "stpc")."""
    plans = [plan] + ([baseline] if baseline is not None else [])
    names = names or tuple(_name(q) for q in plans)
    costs = [{r["block"]: r for r in layer_costs(q)} for q in plans]
    order = list(dict.fromkeys(k for c in costs for k in c))
    label = {k: c[k]["label"] for c in reversed(costs) for k in c}
    top = [c.get(k, {}).get(part, 0.0) for c in costs for k in order for part in ("compute_s", "exposed_s")]
    scale, u = unit([sum(top[i:i + 2]) for i in range(0, len(top), 2)], "seconds")
    fig = new_figure(max(7.0, 1.6 * len(order) * len(plans) + 2), 4.8)
    ax = fig.add_subplot()
    x = np.arange(len(order))
    width = 0.8 / len(plans)
    hatches = ["", "//"]
    for j, (q, c, name) in enumerate(zip(plans, costs, names)):
        pos = x + (j - (len(plans) - 1) / 2) * width
        comp = np.array([c.get(k, {}).get("compute_s", 0.0) for k in order]) / scale
        expo = np.array([c.get(k, {}).get("exposed_s", 0.0) for k in order]) / scale
        hid = np.array([c.get(k, {}).get("hidden_s", 0.0) for k in order]) / scale
        edge = "black" if j else "none"
        ax.bar(pos, comp, width, color=COLORS["compute"], edgecolor=edge, hatch=hatches[j % 2])
        ax.bar(pos, expo, width, bottom=comp, color=COLORS["exposed"], edgecolor=edge, hatch=hatches[j % 2])
        ax.bar(pos, hid, width, bottom=comp + expo, facecolor="white", edgecolor=COLORS["hidden"], hatch="xx",
               linewidth=0.8)
        if len(plans) > 1:
            for xp in pos:
                ax.annotate(name, (xp, 0), xytext=(0, -3), textcoords="offset points", ha="center", va="top",
                            fontsize=7, annotation_clip=False)
        ax.text(0.99, 0.97 - 0.06 * j, f"{name}: step {q.modelled_step_time_s * 1e3:.3f} ms (modelled), "
                f"mesh {'x'.join(map(str, q.mesh_shape))}", transform=ax.transAxes, ha="right", va="top",
                fontsize=8)
    handles = [Patch(color=COLORS["compute"], label="compute"),
               Patch(color=COLORS["exposed"], label="exposed comm (in the step time)"),
               Patch(facecolor="white", edgecolor=COLORS["hidden"], hatch="xx",
                     label="hidden comm (under compute: not in the step time)")]
    if len(plans) > 1:
        handles += [Patch(facecolor="white", edgecolor="black", hatch=hatches[j % 2], label=name)
                    for j, name in enumerate(names)]
    tallest = max(sum(r.get(part, 0.0) for part in ("compute_s", "exposed_s", "hidden_s")) for c in costs
                  for r in c.values())
    ax.set_ylim(0, tallest / scale * 1.35)  # room for the legend and the step times above the bars
    ax.set_xticks(x, [label[k] for k in order], fontsize=8)
    ax.tick_params(axis="x", pad=14 if len(plans) > 1 else 4)
    ax.set_ylabel(f"modelled time per step ({u}), all copies of the layer")
    ax.set_title(f"{plan.model}: modelled step time per distinct layer, "
                 + (" vs ".join(names) if len(plans) > 1 else names[0]) + f" (cluster {plan.cluster})")
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return save(fig, out)


def _name(plan) -> str:
    hints = plan.stats.get("hints")
    return str(hints) if hints else "stpc"
