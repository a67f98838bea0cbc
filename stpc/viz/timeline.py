"""Per-device memory of a plan over one training step, as the planner's memory model
(``cost_models.MemoryModel``) counts it.

What the model holds, and so what is drawn:

* parameters and optimizer state: alive the whole step, at the parts of
  ``plan.stats["breakdown"]``; the gradients only where the model counts them through
  forward (``MemoryModel.grads_at_forward``; by default ``zero_grad`` frees them and they
  come back in backward, shown in the optimizer step's phase of ``plan.summary()``);
* activations kept for backward: each such tensor (``planner.analysis.saved_savers``) at its
  producer's placement (``plan.nodes[...].out``), or as the ops saving it read it where they
  read it through a reshard (``Builder._saved_read_edges``), added when its producer runs in
  forward;
* the transient working set of each op (its local operands and output, a ring's double
  buffer), from the solved problem.

The model gives no order to backward: it says only that the end of forward, where every
saved tensor is alive, is forward's peak (the plan's peak is it, the last layer's backward
or the optimizer step, drawn as a line), and charges the largest transient of any op on top
of it. The timeline therefore mirrors forward: in backward a saved tensor is released once
backward has passed its producer (an approximation; autograd frees it when the op that
saved it is done), and each op's transient is drawn at its forward size. Its highest point
is at most the modelled peak (drawn as a line): the model adds the largest transient to
every activation, wherever that transient occurs. The x axis is op order, not time: the
plan keeps no per-op forward/backward times.

A plan loaded from disk keeps no problem: without the traced graph only the parts at the
peak are drawn; with it (``tg=``) the activations too, without transients. A tensor several
P(2^k x 2^k) ops save jointly is drawn as the planner charged it either way
(``plan.stats["jointly_saved_bytes"]``, saved with the plan).
"""
from __future__ import annotations

import numpy as np
import torch

from stpc.cost_models import MemoryModel
from stpc.placement import shard_factor
from stpc.planner import analyse
from stpc.planner.analysis import saved_savers
from stpc.planner.summary import breakdown
from stpc.viz._figure import COLORS, new_figure, save, unit

PARTS = (("weights", "weight_bytes", "parameters"), ("grads", "grad_bytes", "gradients"),
         ("optimizer", "optimizer_bytes", "optimizer state"), ("activations", "activation_bytes",
                                                               "activations kept for backward"),
         ("transient", "transient_bytes", "largest transient (one op's working set)"))


def memory_timeline(plan, tg=None) -> dict:
    """The modelled per-device bytes along the step: ``{"ops": forward op names in graph
    order, "activations": bytes of saved tensors alive at each forward op (backward mirrors
    it), "transient": each op's working set (None without the solved problem), "persistent":
    {part: bytes} of weights / grads / optimizer, "parts": the breakdown at the peak (None
    if the plan has none), "peak": plan.peak_memory_bytes}``. ``tg``: the traced graph
    (default: the solved problem's); without one, ``ops`` is empty."""
    sv = plan.solved
    tg = tg if tg is not None else (sv.b.tg if sv is not None else None)
    parts = breakdown(plan)  # computed from the problem (and kept in plan.stats), or the saved one
    if parts is not None:
        persistent = {k: float(parts[key]) for k, key, _ in PARTS[:3]}
        persistent["grads"] = float(parts.get("forward_grad_bytes", parts["grad_bytes"]))
    else:  # the parameters' own accounting (NodePlan.mem_bytes): one band
        persistent = {"weights": float(sum(n.mem_bytes for n in plan.nodes.values() if n.role == "param"))}
    out = {"ops": [], "activations": np.zeros(0), "transient": None, "persistent": persistent, "parts": parts,
           "peak": float(plan.peak_memory_bytes)}
    if tg is None:
        return out
    facts = analyse(tg, plan.stats.get("recompute_layers") if plan.stats.get("recompute") else None)
    mesh = tuple(plan.mesh_shape)
    saved = {}
    savers = saved_savers(tg.graph, facts.rg, facts.params)
    joint = plan.stats.get("jointly_saved_bytes") or {}
    for t in savers:
        it = facts.node_item.get(t)
        if it is None or it.kind == "param" or not isinstance(t.meta.get("val"), torch.Tensor):
            continue
        saver = facts.sole_saver.get(it)
        if (saver is not None and not plan.stats.get("recompute") and not facts.head_saved[it]
                and plan.nodes[saver[0].node.name].kind == "p2x2"):
            continue  # (its one saver keeps its own blocks instead: ``Builder._saved_edges``)
        val = t.meta["val"]
        nbytes = val.numel() * val.element_size()
        held = MemoryModel.saved_bytes(nbytes, shard_factor(tuple(plan.nodes[t.name].out), mesh))
        # several savers that may keep their own blocks: what the planner charged, kept with
        # the plan (a plan saved before it was kept: drawn at its producer's placement)
        base = held if plan.stats.get("recompute") else float(joint.get(it.node.name, held))  # (tied copies: one item)
        saved[t.name] = base + sum(_read_delta(t, s, held, nbytes, len(savers[t]), facts, plan, mesh) for s in savers[t])
    # ZeRO-2's whole weights, kept for backward, count with the activations (drawn alive from
    # the first op: the model does not place each layer's gather)
    ops, act, tr, alive = [], [], [], float((parts or {}).get("kept_weight_bytes", 0.0))
    working = sv.problem.forward_transients(sv.choice) if sv is not None else None
    for name, n in plan.nodes.items():
        alive += saved.get(name, 0.0)
        if n.role not in ("decision", "follower"):
            continue
        alive += n.mem_bytes if n.role == "decision" else 0.0  # (blocks a P(2^k x 2^k) op keeps)
        ops.append(name)
        act.append(alive)
        if sv is not None:
            kind, g = sv.group_of(name)
            tr.append(float(working[g]) if kind == "decision" else 0.0)
    out.update(ops=ops, activations=np.array(act), transient=np.array(tr) if sv is not None else None)
    return out


def _read_delta(t, s, held, nbytes, n, facts, plan, mesh) -> float:
    """What saver ``s`` adds to saved tensor ``t`` (held at its producer's placement) by
    reading it through a reshard (directly or through views, ``GraphFacts.saved_operand``),
    its share of ``n`` savers (``Builder._saved_read_edges``)."""
    it, sv = facts.node_item.get(t), facts.node_item.get(s)
    np_ = plan.nodes.get(s.name)
    i = facts.saved_operand(s, t)
    if (sv is None or sv.kind != "decision" or sv.group == it.group or i is None or np_ is None
            or np_.kind == "p2x2" or (plan.stats.get("recompute") and sv in facts.layer_items)):
        return 0.0
    if i >= len(np_.ins) or tuple(np_.ins[i]) == tuple(plan.nodes[t.name].out):
        return 0.0
    return (MemoryModel.saved_bytes(nbytes, shard_factor(tuple(np_.ins[i]), mesh)) - held) / n


def memory(plan, tg=None, out=None):
    """Per-device memory over the step (left: forward ops then backward, the parts stacked;
    right: the parts at the end of forward, which add up to it, under the modelled peak's
    line: above them where the last layer's backward or the optimizer step is the peak). Returns the Figure; saves it
    to ``out`` when given. See the module docstring for what is modelled and what is not."""
    tl = memory_timeline(plan, tg)
    scale, u = unit([tl["peak"]], "bytes")
    fig = new_figure(13, 5.4)
    have_timeline = len(tl["ops"]) > 0
    grid = fig.add_gridspec(1, 2, width_ratios=[3, 1]) if have_timeline else fig.add_gridspec(1, 1)
    title = (f"{plan.model}, mesh {'x'.join(map(str, plan.mesh_shape))}: modelled memory per device "
             f"(MemoryModel; peak {tl['peak'] / scale:.3g} {u})")
    if have_timeline:
        ax = fig.add_subplot(grid[0, 0])
        n = len(tl["ops"])
        x = np.arange(2 * n)
        act = np.concatenate([tl["activations"], tl["activations"][::-1]])
        bands = [(tl["persistent"][k], k) for k, _, _ in PARTS[:3] if k in tl["persistent"]]
        ys = [np.full(2 * n, v / scale) for v, _ in bands] + [act / scale]
        labels = [dict((k, lab) for k, _, lab in PARTS).get(k, "parameters + gradients + optimizer")
                  for _, k in bands] + [PARTS[3][2]]
        colors = [COLORS[k] for _, k in bands] + [COLORS["activations"]]
        ax.stackplot(x, *ys, labels=labels, colors=colors, alpha=0.85, step="post")
        base = sum(ys)
        if tl["transient"] is not None:
            trn = np.concatenate([tl["transient"], tl["transient"][::-1]]) / scale
            ax.fill_between(x, base, base + trn, step="post", color=COLORS["transient"], alpha=0.6, linewidth=0,
                            label="transient (the op's working set)")
        ax.axhline(tl["peak"] / scale, color="black", linestyle="--", linewidth=1,
                   label="modelled peak (the largest of the end of forward, the last layer's backward and the optimizer step)")
        ax.axvline(n, color="gray", linewidth=0.8)
        ax.annotate("end of forward", (n, tl["peak"] / scale * 1.06), xytext=(3, 0), textcoords="offset points",
                    fontsize=8, color="gray", va="center")
        ax.set_xlim(0, 2 * n)
        ax.set_ylim(0, tl["peak"] / scale * 1.12)
        ax.set_xlabel(f"op (graph order): {n} forward ops, then backward in reverse (op index, not time)")
        ax.set_ylabel(f"memory per device ({u})")
        ax.set_title("over the step" + ("" if tl["transient"] is not None else
                                          " (no transients: a plan loaded from disk keeps no problem)"), fontsize=9)
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if tl["parts"] is not None:
        bx = fig.add_subplot(grid[0, 1] if have_timeline else grid[0, 0])
        bottom = 0.0
        for k, key, lab in PARTS:
            v = tl["parts"]["forward_grad_bytes" if key == "grad_bytes" and "forward_grad_bytes" in tl["parts"]
                            else key] / scale
            bx.bar([0], [v], 0.6, bottom=bottom, color=COLORS[k], label=f"{lab}: {v:.3g} {u}")
            bottom += v
        bx.axhline(tl["peak"] / scale, color="black", linestyle="--", linewidth=1)
        bx.set_xticks([0], ["end of forward"])
        bx.set_xlim(-0.6, 0.6)
        bx.set_ylim(0, tl["peak"] / scale * 1.12)
        bx.set_ylabel(f"memory per device ({u})")
        bx.set_title("parts at the end of forward (they add up to it;\nthe dashed line: the plan's peak)",
                     fontsize=9)
        bx.legend(*[list(reversed(h)) for h in bx.get_legend_handles_labels()], fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), title="top to bottom", title_fontsize=7)
    elif not have_timeline:
        raise ValueError("nothing to draw: a plan loaded from disk without its breakdown; pass tg= (its traced "
                         "graph) or re-plan")
    fig.suptitle(title, fontsize=11)
    return save(fig, out)
