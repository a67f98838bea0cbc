"""summary: a plan a person can read. In: a Plan (and, for a plan just planned, the
solver problem it was solved from). Out: text.

* ``summary(plan)`` (``plan.summary()``, the default print of ``python -m stpc plan``):
  the modelled step time split into compute / exposed communication / hidden
  communication, per-device memory split into parameters / gradients / optimizer state /
  activations / transient, then one block per distinct layer (tied layers once, "x 32")
  with a line per matmul-like node (and embedding, attention): its family and layout,
  and why: the best plan in which it does anything else, and how much slower that is.
* ``explain(plan, node)`` (``plan.explain(node)``): the node's strategies ranked by their
  full effect on the objective. An alternative's number is the modelled step time of the
  best plan in which the node's solver group (the node, its followers and its tied copies
  in the other layers) takes that alternative: the problem re-solved with the group fixed
  (variable elimination, tens of milliseconds on llama2-7b; CP-SAT where the memory budget
  binds). A node's own cost plus its input edges (the local ranking kept in
  ``plan.alternatives``) can rank a strategy first that costs more downstream, e.g. a
  Partial output whose all-reduce its consumer then pays.
* ``plan_diff(a, b)``: where two plans differ: mesh, step time, memory, and per distinct
  node the strategies that differ.

The re-solves need the problem, which only a plan planned in this process holds
(:class:`Solved`, kept on the plan, neither serialised nor hashed). A plan loaded from
JSON gets the local ranking, and says so; its summary shows the step and memory split
only if it was computed before the plan was saved (``plan.stats["breakdown"]``).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from stpc.cost_models import CostModel, optimizer_state_bytes
from stpc.placement import REPLICATE, shard_factor
from stpc.planner.analysis import layer_of
from stpc.planner.baselines import first_layers
from stpc.planner.costs import NodeTimer, kept_gathered_bytes
from stpc.planner.sharing import Share
from stpc.planner.solver import Edge, InfeasibleBudget, Problem, memory_blind_optimum, solve
from stpc.planner.strategies import tensor_operands

NS = 1e9  # the Problem's unit: integer nanoseconds (``builder.NS``)
GIB = 2**30

# Ops a summary line is given to: the matmul-like ones, embeddings and attention.
SHOWN_OPS = ("linear.default", "mm.default", "addmm.default", "bmm.default", "baddbmm.default", "matmul.default",
             "embedding.default", "scaled_dot_product_attention.default")

__all__ = ["Alternative", "Solved", "summary", "explain", "plan_diff", "breakdown", "layer_key"]


# ---------------------------------------------------------------------------- re-solving


@dataclass
class Alternative:
    """One strategy of a group and the best plan in which the group takes it."""

    label: str
    choice: int
    step_s: float                 # modelled step time of that plan
    peak_bytes: float
    how: str = "exact"            # chosen | exact | bound (the memory-blind optimum, over the budget: a
                                  # lower bound) | feasible (CP-SAT's time ran out: an upper bound)
    lower_s: float | None = None  # a lower bound of the step time where it is not exact


class _FreeComm(CostModel):
    """The same cost model with every transfer free: a plan's cost under it is its compute."""

    def all_gather(self, nbytes, axis, *_):
        return 0.0

    reduce_scatter = all_reduce = all_to_all = p2p = all_gather

    def ring_step(self, compute_s, transfer_s, slowdown=None):  # (a ring step's overhead counts with its transfer)
        return compute_s


class _FreeCompute(CostModel):
    """The same cost model with compute free: a ring's cost under it is its transfers."""

    def compute(self, flops, bytes_moved, dtype="fp32", op=""):
        return 0.0

    gemm = compute

    def batched_gemm_extra(self, batch, weight_bytes):
        return 0.0


class Solved:
    """What a Plan planned in this process keeps of its solve: the builder (graph facts,
    strategies, costs), the integer problem and the chosen assignment. Not serialised
    (``Plan.__getstate__`` drops it), not in the hash."""

    def __init__(self, builder, problem: Problem, choice: list[int], objective_ns: int, peak_bytes: int):
        self.b, self.problem, self.choice = builder, problem, list(choice)
        self.objective_ns, self.peak = objective_ns, peak_bytes
        self._nodes = {n.name: n for n in builder.graph.nodes}
        self._ranked: dict = {}
        self._breakdown = None
        self._perms = None

    # ---------------------------------------------------------------- groups
    def group_of(self, node_name: str):
        """(item kind, group) of a node: ``decision``/``param``/``input`` own their group;
        ``follower``/``derived`` take their source's; None for nodes outside every group."""
        node = self._nodes.get(node_name)
        it = self.b.facts.node_item.get(node) if node is not None else None
        return (it.kind, it.group) if it is not None else (None, None)

    def group_node(self, g: int) -> str:
        return self.b.facts.group_items[g].node.name

    def label(self, g: int, c: int) -> str:
        choices = self.b.groups[g].strategies
        if self.b.facts.group_items[g].kind == "decision":
            return strategy_label(choices[c])
        return _fmt(choices[c])

    def mirror_key(self, g: int, c: int) -> str:
        """One key for a choice and its mirror images: the same strategy with interchangeable
        mesh axes (same size, same links) swapped, which costs the same in a plan mirrored
        alike. The ranking counts them as one alternative."""
        choices = self.b.groups[g].strategies
        dec = self.b.facts.group_items[g].kind == "decision"
        return min((strategy_label(_permuted(choices[c], pi)) if dec else _fmt([choices[c][a] for a in pi]))
                   for pi in self.perms())

    def perms(self) -> list[tuple[int, ...]]:
        """Axis orders that leave every cost as it is (``_axis_perms``)."""
        if self._perms is None:
            self._perms = _axis_perms(self.b.cm)
        return self._perms

    def modules(self) -> dict[str, str]:
        """Node name -> the nn.Module path it came from."""
        return {name: n.meta.get("module") or "" for name, n in self._nodes.items()}

    # ---------------------------------------------------------------- full effect
    def ranked(self, g: int, top: int = 6, exact_budget: bool = True, time_limit_s: float = 20.0) -> list[Alternative]:
        """Group ``g``'s strategies by full effect, best first: the chosen one (the plan's
        own step time: it is the optimum), then repeatedly the best plan whose choice for
        ``g`` differs from every one listed, until ``top`` are listed or none is left. Each
        is one re-solve of the problem restricted to the remaining choices of ``g``.
        Where its memory-blind optimum does not fit the budget: CP-SAT under the budget
        (``exact_budget``, each solve limited to ``time_limit_s``), else that optimum as a
        lower bound (``how="bound"``). (The chosen one is the optimum when the plan's own
        solve was: ``plan.stats["status"] == "OPTIMAL"``.)"""
        key = (g, top, exact_budget)
        if key in self._ranked:
            return self._ranked[key]
        t_end = time.perf_counter() + time_limit_s * (top - 1)
        n = len(self.problem.cost[g])
        keys = [self.mirror_key(g, c) for c in range(n)]
        chosen = self.choice[g]
        out = [Alternative(self.label(g, chosen), chosen, self.objective_ns / NS, float(self.peak), "chosen")]
        listed = {keys[chosen]}
        while len(out) < top:
            keep = [c for c in range(n) if keys[c] not in listed]
            if not keep:
                break
            alt = self._best_with(g, keep, exact_budget, min(time_limit_s, t_end - time.perf_counter()))
            if alt is None:  # no remaining choice fits the budget
                break
            alt.label = self.label(g, alt.choice)
            out.append(alt)
            listed.add(keys[alt.choice])
        self._ranked[key] = out
        return out

    def best_where(self, g: int, accept, exact_budget: bool = True, time_limit_s: float = 20.0) -> Alternative | None:
        """The best plan in which group ``g`` takes a strategy ``accept(strategy)`` holds for
        (the rest re-solved, as :meth:`ranked` does); None if none does or none fits the budget."""
        choices = self.b.groups[g].strategies
        keep = [c for c in range(len(choices)) if accept(choices[c])]
        if not keep:
            return None
        if self.choice[g] in keep:
            return Alternative(self.label(g, self.choice[g]), self.choice[g], self.objective_ns / NS,
                               float(self.peak), "chosen")
        alt = self._best_with(g, keep, exact_budget, time_limit_s)
        if alt is not None:
            alt.label = self.label(g, alt.choice)
        return alt

    def _best_with(self, g: int, keep: list[int], exact_budget: bool, time_limit_s: float) -> Alternative | None:
        """The best plan with group ``g`` limited to ``keep``; None if none fits the budget."""
        q = restrict(self.problem, g, keep)
        blind, bound, peak = memory_blind_optimum(q)
        if blind is not None and (q.budget is None or peak <= q.budget):
            return self._alternative(g, keep, blind, "exact")
        lower = max(bound, self.objective_ns) / NS if blind is not None else self.objective_ns / NS
        if exact_budget and time_limit_s > 0:
            try:
                sol = solve(q, time_limit_s=time_limit_s, method="cpsat")
            except InfeasibleBudget:
                return None
            except RuntimeError:  # no solution within the time limit
                sol = None
            if sol is not None:
                how = "exact" if sol.status == "OPTIMAL" else "feasible"
                return self._alternative(g, keep, sol.choice, how, None if how == "exact" else lower)
        if blind is None:
            return None
        return self._alternative(g, keep, blind, "bound", lower)

    def _alternative(self, g, keep, choice, how, lower=None) -> Alternative:
        full = list(choice)
        full[g] = keep[choice[g]]
        obj, peak = self.problem.evaluate(full)
        return Alternative("", full[g], obj / NS, float(peak), how, lower)

    # ---------------------------------------------------------------- breakdown
    def breakdown(self) -> dict:
        """The plan's modelled step time and peak memory, split (see :func:`breakdown`)."""
        if self._breakdown is None:
            self._breakdown = _breakdown(self)
        return self._breakdown


def _axis_perms(cm) -> list[tuple[int, ...]]:
    """Orders of the mesh axes that only swap axes of equal ``axis_signature``."""
    sig = [cm.axis_signature(a) for a in range(len(cm.mesh_shape))]
    return [pi for pi in itertools.permutations(range(len(sig))) if all(sig[a] == sig[b] for a, b in enumerate(pi))]


def _permuted(s, pi):
    """Strategy ``s`` with its mesh axes reordered: axis a takes what axis pi[a] had."""
    return _Strategy(tuple(s.out[b] for b in pi), tuple(tuple(p[b] for b in pi) for p in s.ins), s.kind,
                     pi.index(s.axis) if s.axis >= 0 else s.axis)


@dataclass(frozen=True)
class _Strategy:
    out: tuple
    ins: tuple
    kind: str
    axis: int


def restrict(p: Problem, g: int, keep: list[int]) -> Problem:
    """``p`` with group ``g`` limited to the choices ``keep`` (their indices in ``p``): the
    same problem otherwise. A solution's ``choice[g]`` indexes ``keep``."""
    idx = np.asarray(keep, dtype=np.intp)

    def sub(seq):
        return tuple(seq[c] for c in keep)

    full = [list(range(len(c))) for c in p.cost]
    full[g] = list(keep)
    edges = [e if g not in (e.u, e.v) else
             Edge(e.u, e.v, sub(e.ucls) if e.u == g else e.ucls, sub(e.vcls) if e.v == g else e.vcls, e.table)
             for e in p.edges]
    shares = []
    for s in p.shares:
        if s.u == g:
            s = Share(s.u, s.vs, s.ucls[idx], s.keys, s.cost, [(uc[idx], kc, t) for uc, kc, t in s.axes])
        elif g in s.vs:
            s = Share(s.u, s.vs, s.ucls, tuple(k[idx] if v == g else k for v, k in zip(s.vs, s.keys)), s.cost,
                      s.axes)
        shares.append(s)
    q = p.restricted(full, edges, shares)
    q.cap = None
    return q


def _breakdown(sv: Solved) -> dict:
    """Step time = compute + exposed communication (+ hidden communication beside it, not in
    the step); peak = parameters + gradients + optimizer + activations + transient.

    * compute: the same assignment costed with every transfer free (``_FreeComm``): every
      op's roofline time of its local work, forward + backward + weight gradient, and the
      optimizer step over the parameter state each device holds (``optimizer_step_s``);
    * exposed: the rest of the step time: reshards on edges and shares, gathers of
      followers that cannot keep a layout, skewed grid weights relaid from their stored
      blocks, ring transfers longer than the compute of their step, parameter
      synchronisation beyond its op's compute (with the compute slowdown
      under overlap, ``cost_models.overlap``, and the runtime's copies around it,
      ``costs.param_copy_phases``);
    * hidden: transfers that run beside compute and do not add to the step: ring transfers
      under their step's GEMM (a ring costs sum max(compute, transfer)), parameter
      synchronisation under its op's compute (``min(comm, window)`` per phase and axis);
    * ring ops (``ring_ops_s``): the temporal families' ops whole, their step GEMMs and their
      exposed transfers (what the fidelity bench holds against the ring ops' wall time).
    """
    b, p, ch = sv.b, sv.problem, sv.choice
    cm = b.cm
    step_s = sv.objective_ns / NS
    layout = b.memory.layout
    facts = b.facts
    # compute: the same problem's groups under a cost model with free transfers
    free = type(b)(b.tg, _FreeComm(cm.cluster, cm.mesh_shape, cm.overlap_slowdown), b.hints, b.memory, facts)
    free.build(None, edges=False)
    compute = sum(float(free.groups[g].cost[c]) for g, c in enumerate(ch))
    # (a parameter's own cost is its optimizer step; a skewed grid weight's relayout is a transfer)
    optimizer_step = sum(float(free.groups[g].cost[ch[g]]) for g, it in enumerate(facts.group_items)
                         if it.kind == "param")
    groups = sum(float(b.groups[g].cost[c]) for g, c in enumerate(ch))
    # rings: real = sum max(c, t) (+ the slowdown and overhead); compute C, transfers T:
    # hidden = C + T - real, none where compute slowed by more than the transfer took
    ring_exposed = ring_hidden = ring_ops = 0.0
    transfers = _FreeCompute(cm.cluster, cm.mesh_shape, cm.overlap_slowdown)
    for g, it in enumerate(facts.group_items):
        if it.kind != "decision":
            continue
        s = b.groups[g].strategies[ch[g]]
        if s.kind in ("spatial", "replicate-fallback"):
            continue
        real, comp = b.groups[g].own_cost[ch[g]], free.groups[g].own_cost[ch[g]]
        timer = NodeTimer(it.node, transfers, [o in b.rg for o in tensor_operands(it.node)])
        t = timer(s) + (timer.forward(s) if b.recompute and it in facts.layer_items else 0.0)  # (its replay)
        ring_exposed += (real - comp) * it.count
        ring_ops += real * it.count
        ring_hidden += max(0.0, comp + t - real) * it.count
    # edges: parameter edges overlap (cost_models.overlap), the others do not
    is_param = [it.kind == "param" for it in facts.group_items]

    def edge_sum(problem, params: bool) -> float:
        return sum(e.table.get((e.ucls[ch[e.u]], e.vcls[ch[e.v]]), 0) for e in problem.edges
                   if is_param[e.u] == params) / NS

    param_real = edge_sum(p, True)
    other_edges = edge_sum(p, False) + sum(s.value(ch) for s in p.shares) / NS
    # the parameter edges again with another overlap slowdown s2: exposed(s) = comm - (1 - s) * hidden
    s1 = cm.overlap_slowdown
    s2 = 1.0 if s1 < 1.0 else 0.0
    other = type(b)(b.tg, CostModel(cm.cluster, cm.mesh_shape, s2), b.hints, b.memory, facts)
    param_other = edge_sum(other.build(None), True)
    param_hidden = max(0.0, (param_other - param_real) / (s2 - s1))
    slowdown = s1 * param_hidden
    gathers = groups - compute - ring_exposed  # followers/derived ops that gather to keep going; weights relaid
    exposed = groups - compute + param_real + other_edges
    # memory: persistent parts under the chosen placements + the largest transient
    weight = grad = opt = kept = head_kept = bucketed = 0.0
    mesh = b.mesh
    for g, it in enumerate(facts.group_items):
        if it.kind != "param" or it.node.name in b._tied_copies:
            continue
        pl = b.place[it][ch[g]]
        shards = math.prod(n for n, t in zip(mesh, pl) if t != REPLICATE)
        parts = optimizer_state_bytes(it.node.meta["val"].numel() / shards, layout, 1, 1, b.memory.fp32_grad_accum)
        weight += parts.weight * it.count
        grad += parts.grad * it.count
        if b._bucketed(it.node, pl):
            bucketed += parts.grad * it.count  # (its bucket kept between steps: held through forward)
        opt += parts.optimizer * it.count
        if not (b.recompute and layer_of(it.node) in facts.recomputed):  # (a recomputed layer's are gathered again)
            k = kept_gathered_bytes(it.node.meta["val"], pl, mesh, b.hints.keep_gathered) * it.count
            kept += k
            head_kept += k if it in b._freed_by_head else 0.0  # (kept for the head alone: its backward frees it)
    act = kept  # (ZeRO-2's whole weights, kept for backward, count with the activations)
    for g, it in enumerate(facts.group_items):  # ... and the blocks a P(2^k x 2^k) op keeps
        if it.kind == "decision":
            act += b.groups[g].own_mem[ch[g]] * it.count
    head_act = 0.0  # (of those, the ones only the head's ops saved: gone in the last layer's backward)
    # (recomputed layers keep their inputs and what the head saves: ``GraphFacts.kept_saved``)
    saved, head = (facts.kept_saved, facts.kept_head_saved) if b.recompute else (facts.saved_uses, facts.head_saved)
    for it, count in saved.items():
        val = it.node.meta["val"]
        local = b.memory.saved_bytes(val.numel() * val.element_size(), shard_factor(b.place[it][ch[it.group]], mesh))
        act += count * local
        head_act += head[it] * local
    # (less the tensors whose only saver keeps its own blocks instead: ``Builder._saved_edges``)
    act += sum(e.table.get((e.ucls[ch[e.u]], e.vcls[ch[e.v]]), 0) for e in p.saved_edges)
    # what the head's backward frees besides: the copies its savers read through a reshard (the
    # loss's gathered logits), the weights kept whole for it (``Builder.add_memory_edges``)
    freed_by_head = b._saved_read_edges()[1] + b._kept_head_edges()[1]
    head_act += head_kept - sum(e.table.get((e.ucls[ch[e.u]], e.vcls[ch[e.v]]), 0) for e in freed_by_head)
    transient = max(p.forward_transients(ch), default=0)  # (with the loss's copy for a resharded operand)
    bwd_transient = max((p.backward_transient[g][c] for g, c in enumerate(ch)), default=0)
    forward_peak, head_peak, backward_peak, step_peak = p.phase_peaks(ch)
    return {"step_s": step_s, "compute_s": compute, "optimizer_step_s": optimizer_step, "exposed_s": exposed, "hidden_s": ring_hidden + param_hidden,
            "exposed_reshard_s": other_edges + gathers, "exposed_ring_s": ring_exposed, "ring_ops_s": ring_ops,
            "exposed_param_sync_s": param_real, "overlap_slowdown_s": slowdown,
            "hidden_ring_s": ring_hidden, "hidden_param_sync_s": param_hidden,
            "peak_bytes": float(sv.peak), "weight_bytes": weight, "grad_bytes": grad, "optimizer_bytes": opt,
            "activation_bytes": act, "head_activation_bytes": head_act, "transient_bytes": float(transient),
            "backward_transient_bytes": float(bwd_transient) if p.has_bwd_phase else 0.0,
            "forward_peak_bytes": float(forward_peak), "step_peak_bytes": float(step_peak),
            "backward_peak_bytes": float(backward_peak),  # (0: a problem without that phase)
            # the head's gradients reduced, its backward done (0: a problem without that phase)
            "head_backward_peak_bytes": float(head_peak),
            # the gradients the end of forward holds (0: zero_grad frees them, MemoryModel.grads_at_forward)
            # (or the summed ones' buckets, where the runtime keeps them: MemoryModel.kept_buckets)
            "forward_grad_bytes": grad if b.memory.grads_at_forward else bucketed,
            "kept_weight_bytes": kept,  # (part of activation_bytes)
            "step_scratch_bytes": float(step_peak - (weight + grad + opt)) if p.has_step_phase else 0.0}


def breakdown(plan) -> dict | None:
    """``plan``'s step-time and memory split (:func:`_breakdown`'s keys), computed from its
    problem and kept in ``plan.stats["breakdown"]`` (so a saved plan keeps it); None for a
    plan loaded without one."""
    sv = getattr(plan, "_solved", None)
    if sv is not None and "breakdown" not in plan.stats:
        plan.stats["breakdown"] = sv.breakdown()
    return plan.stats.get("breakdown")


def compute_by_op(plan) -> dict[str, float]:
    """``plan``'s modelled compute (:func:`_breakdown`'s ``compute_s``: every op's local work
    with transfers free, forward + backward + weight gradient, all tied copies) split by aten
    op (``str(node.target)``), the optimizer step under ``"optimizer"``. Summed, it is the
    breakdown's ``compute_s``. What a profile of the same step is held against, op kind by op
    kind (``benchmarks/cuda_check.py``). Needs the solved problem (a plan planned in this
    process)."""
    sv = getattr(plan, "_solved", None)
    if sv is None:
        raise ValueError("compute by op needs the solved problem, which a plan loaded from disk does not keep: "
                         "re-plan the model (stpc.search) in this process")
    b, ch = sv.b, sv.choice
    free = type(b)(b.tg, _FreeComm(b.cm.cluster, b.cm.mesh_shape, b.cm.overlap_slowdown), b.hints, b.memory,
                   b.facts)
    free.build(None, edges=False)
    out: dict[str, float] = {}
    for it in b.facts.items:
        c = ch[it.group]
        if it.kind == "decision":
            sec, key = float(free.groups[it.group].own_cost[c]), str(it.node.target)
        elif it.kind in ("follower", "derived"):
            sec, key = float(free.extra[it][c]), str(it.node.target)
        elif it.kind == "param":
            sec, key = float(free.groups[it.group].own_cost[c]), "optimizer"
        else:
            continue
        out[key] = out.get(key, 0.0) + sec * it.count
    return out


# ---------------------------------------------------------------------------- formatting


def _fmt(placement) -> str:
    return "(" + ",".join(placement) + ")"


def strategy_label(s) -> str:
    """``[family@axis ]operands -> output``: a Strategy (or NodePlan) in one line, one
    placement per tensor operand and for the output, one token per mesh axis."""
    tag = "" if s.kind in ("spatial", "") else f"{s.kind}@{s.axis} "
    return tag + "·".join(_fmt(p) for p in s.ins) + " -> " + _fmt(s.out)


def _ms(s: float, sign: bool = False) -> str:
    v = s * 1e3
    digits = 3 if abs(v) < 100 else 2
    return f"{v:+.{digits}f} ms" if sign else f"{v:.{digits}f} ms"


def _bytes(x: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size or unit == "KiB":
            return f"{x / size:.2f} {unit}" if abs(x) >= 10 * size else f"{x / size:.3f} {unit}"
    return f"{x:.0f} B"


def layer_key(module: str) -> tuple[str, str]:
    """(layer, path inside it) of a module path: the layer is the prefix up to the first
    numeric component (``layers.3``, ``model.layers.3``, ``transformer.h.3``); ("", path)
    for modules outside a repeated stack."""
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1]), ".".join(parts[i + 1:])
    return "", module


def _blocks(plan, keep) -> list[dict]:
    """Nodes ``keep(name, node)`` accepts, grouped by distinct layer in graph order: a layer
    whose nodes are tied to an earlier one's (``tied_to``) is folded into that layer's
    block and counted; nodes outside the layers form a block per run."""
    blocks: list[dict] = []
    by_rep: dict[str, dict] = {}
    last_top = None
    for name, n in plan.nodes.items():
        if not keep(name, n):
            continue
        layer, inner = layer_key(n.module)
        if not layer:
            if last_top is None:
                last_top = {"layer": "", "layers": [], "nodes": []}
                blocks.append(last_top)
            last_top["nodes"].append((name, inner or name))
            continue
        last_top = None
        rep_layer = layer_key(plan.nodes[n.tied_to].module)[0] if n.tied_to in plan.nodes else layer
        blk = by_rep.get(rep_layer or layer)
        if blk is None:
            blk = by_rep[rep_layer or layer] = {"layer": rep_layer or layer, "layers": [], "nodes": []}
            blocks.append(blk)
        if layer not in blk["layers"]:
            blk["layers"].append(layer)
        if not n.tied_to:
            blk["nodes"].append((name, inner or name))
    return blocks


def _block_title(blk) -> str:
    if not blk["layer"]:
        return "outside the repeated layers"
    k = len(blk["layers"])
    if k == 1:
        return blk["layers"][0]
    return f"{blk['layers'][0]} .. {blk['layers'][-1]}  (x {k}, tied: planned once)"


def _shown(name, n) -> bool:
    return n.role == "decision" and n.op in SHOWN_OPS


def _why(plan, name: str, deadline: float) -> str:
    """A shown node's cheapest alternative and what it costs: full effect where the plan
    holds its problem, else the local estimate. Where the budget binds, the re-solve is
    CP-SAT's, as long as ``deadline`` allows; past it, the memory-blind lower bound."""
    sv = plan.solved if hasattr(plan, "solved") else None
    if sv is not None:
        kind, g = sv.group_of(name)
        if g is None or kind != "decision":
            return ""
        left = deadline - time.perf_counter()
        ranked = sv.ranked(g, top=2, exact_budget=left > 0, time_limit_s=max(left, 0.0))
        if len(ranked) < 2:
            return "the only choice" if len(sv.problem.cost[g]) < 2 else "no other strategy fits the budget"
        base, alt = ranked[0].step_s, ranked[1]
        d = alt.step_s - base
        pct = f" ({d / base:+.2%})" if base else ""
        if alt.how == "bound":  # not re-solved under the budget in time: its best plan ignoring memory
            return (f"next {alt.label}: not solved under the budget in time (ignoring memory {_ms(d, True)} at "
                    f"{_bytes(alt.peak_bytes)}); plan.explain({name!r}) solves it")
        if alt.how == "feasible":
            return f"next {alt.label}: between {_ms(alt.lower_s - base, True)} and {_ms(d, True)}"
        return f"next {alt.label}: {_ms(d, True)}{pct}"
    n = plan.nodes[name]
    alts = plan.alternatives.get(n.tied_to or name) or []
    mine = next((t for dsc, t in alts if dsc == n.describe()), None)
    other = next(((dsc, t) for dsc, t in alts if dsc != n.describe()), None)
    if mine is None or other is None:
        return "the only choice" if not alts else ""
    return f"next {other[0]}: {_ms(other[1] - mine, True)} locally"


def _peak_phase(bd: dict) -> str:
    phases = {"end of forward": bd["forward_peak_bytes"],
              "head's gradient reduction": bd.get("head_backward_peak_bytes", 0.0),
              "last layer's backward": bd.get("backward_peak_bytes", 0.0), "optimizer step": bd["step_peak_bytes"]}
    return max(phases, key=phases.get)


def summary(plan, cpsat_s: float = 2.0) -> str:
    """The plan in a page (see the module docstring). Where the memory budget binds, the
    alternatives are re-solved by CP-SAT for up to ``cpsat_s`` seconds in all; past that
    a line says it was not solved in time (``plan.explain(node)`` solves it)."""
    t0 = time.perf_counter()
    sv = plan.solved if hasattr(plan, "solved") else None
    st = plan.stats
    mesh = "x".join(map(str, plan.mesh_shape))
    lines = [f"plan {plan.hash()[:12]}  model {plan.model}  mesh {mesh}  cluster {plan.cluster}  {plan.dtype}"
             + (f"  batch {st['batch']} seq {st['seq']}" if st.get("batch") else "")]
    if st.get("indivisible"):
        lines.append("dims no mesh axis divides (never split): " + ", ".join(
            f"{k} {v}" for k, v in st["indivisible"].items()))
    bd = breakdown(plan)
    k = plan.stats.get("recompute_layers")  # (only the first k layers recomputed: the others keep theirs)
    which, rest = (first_layers(k), ", and what the other layers' ops save") if k else ("layers", "")
    step = plan.modelled_step_time_s
    lines += ["", f"step time, modelled (one step: forward + backward + weight gradients + optimizer step): "
                  f"{_ms(step)}"]
    if bd:
        sub = [("reshards and collectives on the critical path", bd["exposed_reshard_s"], ""),
               ("parameter sync beyond its op's compute", bd["exposed_param_sync_s"],
                f"of which {_ms(bd['overlap_slowdown_s'])} is compute slowed beside the hidden part"),
               ("ring transfers longer than their step's compute", bd["exposed_ring_s"], "")]
        hid = [("parameter sync under its op's compute", bd["hidden_param_sync_s"], ""),
               ("ring transfers under their step's matmul", bd["hidden_ring_s"], "")]
        lines.append(f"  compute        {_ms(bd['compute_s']):>12}  every op's local work (roofline), as if "
                     "transfers were free")
        if bd.get("optimizer_step_s"):
            impl = st.get("optimizer", {}).get("impl", "foreach")  # (a plan saved before it was recorded)
            lines.append(f"    {'of which the optimizer step (memory-bound)':48s} {_ms(bd['optimizer_step_s']):>12}"
                         f"  (AdamW, {impl})")
        lines.append(f"  exposed comm   {_ms(bd['exposed_s']):>12}  what transfers add to the step:")
        lines += [f"    {what:48s} {_ms(v):>12}" + (f"  ({note})" if note else "") for what, v, note in sub]
        lines.append(f"  hidden comm    {_ms(bd['hidden_s']):>12}  transfers beside compute, not in the step time:")
        lines += [f"    {what:48s} {_ms(v):>12}" for what, v, _ in hid]
        lines.append("  compute + exposed comm = the step time")
    else:
        lines.append("  (its split is unknown: a plan loaded from disk that was saved without one; re-plan to see it)")
    budget = f" (budget {_bytes(plan.budget_bytes)})" if plan.budget_bytes else ""
    lines.append(f"memory per device, modelled peak: {_bytes(plan.peak_memory_bytes)}{budget}")
    if bd:
        lines += [
            f"  parameters     {_bytes(bd['weight_bytes']):>12}",
            f"  gradients      {_bytes(bd['grad_bytes']):>12}",
            f"  optimizer      {_bytes(bd['optimizer_bytes']):>12}  optimizer state (and fp32 master weights)",
            f"  activations    {_bytes(bd['activation_bytes']):>12}  kept for backward"
            + {"full": f" ({which} recomputed in backward: only their inputs and the head's{rest})",
               "selective": f" ({which} recomputed in backward but for their matmuls and fused attentions: "
                            f"their inputs, those outputs and the head's{rest})"}.get(plan.stats.get("recompute"), ""),
            f"  transient      {_bytes(bd['transient_bytes']):>12}  the largest working set of one op"]
        if "step_peak_bytes" not in bd:  # (a plan saved before the optimizer step's phase was modelled)
            lines.append("  the peak is at the end of forward, all of these alive at once: they add up to it")
        else:
            lines += [
                f"  optimizer scratch {_bytes(bd['step_scratch_bytes']):>9}  the optimizer step's temporaries (under fused "
                "AdamW none: there the last summed gradient's second copy at backward's end)",
                f"  end of forward {_bytes(bd['forward_peak_bytes']):>12}  parameters + optimizer + activations + "
                "transient" + ((" + gradients" if bd.get("forward_grad_bytes") == bd.get("grad_bytes") else
                                " + the summed gradients' buckets, kept between steps (zero_grad freed the others)")
                               if bd.get("forward_grad_bytes") else " (zero_grad freed the gradients)"),
                f"  head's gradients {_bytes(bd.get('head_backward_peak_bytes', 0.0)):>10}  the end of forward less "
                "what the head saved (and its weights kept whole) + the gradients the head computed, at the placement "
                "it read them in + the buffers reducing them",
                f"  last layer's backward {_bytes(bd.get('backward_peak_bytes', 0.0)):>5}  the end of forward with "
                "that layer's largest working set for the transient + the gradients the head and the last layer "
                "compute + ZeRO-3 weights gathered again for it",
                f"  optimizer step {_bytes(bd['step_peak_bytes']):>12}  parameters + gradients + optimizer + "
                "optimizer scratch (activations are freed; or backward's end, the same state)",
                "  the peak is the largest phase: the " + _peak_phase(bd)]
    lines += ["", "per distinct layer, each matmul-like op: module, node, strategy ([family@axis] operand "
                  "placements -> output placement, a token per mesh axis),",
              "next: " + ("the best plan in which it takes any other strategy (mirror images over interchangeable "
                          "mesh axes count as its own), its step time against this plan's" if sv is not None else
                          "the locally cheapest other strategy (the node + its input edges, neighbours as planned: "
                          "a plan loaded from disk cannot be re-solved)")]
    blocks = _blocks(plan, _shown)
    deadline = time.perf_counter() + cpsat_s
    rows = [[(inner, name, strategy_label(plan.nodes[name]), _why(plan, name, deadline))
             for name, inner in blk["nodes"]] for blk in blocks]
    w = [max((len(r[i]) for rs in rows for r in rs), default=0) for i in range(3)]
    for blk, rs in zip(blocks, rows):
        lines.append(_block_title(blk))
        lines += ["  " + "  ".join(c.ljust(x) for c, x in zip(r[:3], w)) + "  " + r[3] for r in rs]
    lines += ["", "families (decision nodes, all layers): "
              + ", ".join(f"{k} {v}" for k, v in plan.strategy_counts().items())]
    if sv is not None:
        plan.stats["summary_time_s"] = time.perf_counter() - t0
    return "\n".join(line.rstrip() for line in lines) + "\n"


def explain(plan, node_name: str, top: int = 6, time_limit_s: float = 10.0) -> str:
    """``node_name``'s strategy and its alternatives ranked by full effect (module docstring);
    the local ranking for a plan loaded from disk. Where the memory budget binds, each
    alternative is CP-SAT's, up to ``time_limit_s`` (then the best found, marked)."""
    if node_name not in plan.nodes:
        raise KeyError(f"no node {node_name!r} in the plan")
    n = plan.nodes[node_name]
    rep = n.tied_to or node_name
    lines = [f"{node_name} ({n.op}, {n.role}): {strategy_label(n) if n.role == 'decision' else n.describe()}"
             + (f"  [{n.module}]" if n.module else "") + (f"  [tied to {n.tied_to}]" if n.tied_to else "")]
    sv = plan.solved if hasattr(plan, "solved") else None
    if sv is not None:
        kind, g = sv.group_of(node_name)
        if kind in ("follower", "derived"):
            src = sv.group_node(g)
            lines.append(f"  no alternatives of its own: its placement follows {src}'s choice "
                         f"(plan.explain({src!r}))")
            return "\n".join(lines)
        if g is None or len(sv.problem.cost[g]) < 2:
            lines.append("  no alternatives: a single choice")
            return "\n".join(lines)
        copies = sum(1 for v in plan.nodes.values() if v.tied_to == rep) + 1
        ranked = sv.ranked(g, top=top, exact_budget=True, time_limit_s=time_limit_s)
        best = ranked[0].step_s
        who = "this node" + (f" (and its {copies - 1} tied copies)" if copies > 1 else "")
        lines.append(f"  alternatives ranked by full effect: the modelled step time of the best plan in which {who} "
                     f"takes the strategy, the rest re-solved ({len({repr(s) for s in sv.b.groups[g].strategies})} "
                     f"strategies; mirror images "
                     f"over interchangeable mesh axes count as one):")
        lines.append(f"    {'strategy':48s} {'step ms':>12} {'vs chosen':>12} {'peak':>12}")
        for a in ranked:
            mark = "*" if a.how == "chosen" else " "
            note = ""
            if a.how == "feasible":
                note = f"  (CP-SAT's time ran out: the best found; the optimum is ≥ {a.lower_s * 1e3:.4f})"
            elif a.how == "bound":
                note = f"  (not solved under the budget in time: its best plan ignoring memory; ≥ {a.lower_s * 1e3:.4f})"
            lines.append(f"  {mark} {a.label:48s} {a.step_s * 1e3:12.4f} {(a.step_s - best) * 1e3:+12.4f} "
                         f"{_bytes(a.peak_bytes):>12}{note}")
        if len(ranked) == 1:
            lines.append("    (no other strategy fits the memory budget)")
        return "\n".join(lines)
    alts = plan.alternatives.get(rep)
    if not alts:
        lines.append("  no alternatives: " + ("follows its input" if n.role == "follower" else "a single choice"))
        return "\n".join(lines)
    lines.append("  alternatives, local ranking only (modelled ms of the node + its input edges, neighbours as "
                 "planned). This plan was loaded from disk and keeps no problem to re-solve: a strategy ranked "
                 "above the chosen one here costs more elsewhere in the plan. Re-plan for the full effect.")
    for desc, secs in alts:
        mark = "*" if desc == n.describe() else " "
        lines.append(f"  {mark} {desc:40s} {secs * 1e3:10.4f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- diff


def _same_graph(a, b) -> bool:
    return a.nodes.keys() == b.nodes.keys()


def plan_diff(a, b, limit: int = 60) -> str:
    """Where plans ``a`` and ``b`` differ, as text: mesh, modelled step time and peak memory
    (with deltas; the step split where both have one), then per distinct layer (tied
    layers once, "x N") each matmul-like op whose strategy differs, both sides; other
    decision nodes and parameter placements that differ are counted."""
    mesh = ["x".join(map(str, p.mesh_shape)) for p in (a, b)]
    lines = [f"a: plan {a.hash()[:12]}  {a.model}  mesh {mesh[0]}  cluster {a.cluster}  {a.dtype}",
             f"b: plan {b.hash()[:12]}  {b.model}  mesh {mesh[1]}  cluster {b.cluster}  {b.dtype}"]
    if a.hash() == b.hash():
        return "\n".join(lines + ["the plans are identical"]) + "\n"
    for what, va, vb in (("mesh", mesh[0], mesh[1]), ("model", a.model, b.model), ("cluster", a.cluster, b.cluster),
                         ("dtype", a.dtype, b.dtype)):
        if va != vb:
            lines.append(f"{what}: {va} -> {vb}")
    ds = b.modelled_step_time_s - a.modelled_step_time_s
    pct = f", {ds / a.modelled_step_time_s:+.2%}" if a.modelled_step_time_s else ""
    lines.append(f"step time: {_ms(a.modelled_step_time_s)} -> {_ms(b.modelled_step_time_s)}  ({_ms(ds, True)}{pct})")
    bda, bdb = breakdown(a), breakdown(b)
    if bda and bdb:
        lines.append("  " + ", ".join(f"{k} {_ms(bda[f'{k}_s'])} -> {_ms(bdb[f'{k}_s'])}"
                                      for k in ("compute", "exposed", "hidden")))
    dm = b.peak_memory_bytes - a.peak_memory_bytes
    lines.append(f"peak memory per device: {_bytes(a.peak_memory_bytes)} -> {_bytes(b.peak_memory_bytes)}  "
                 f"({'+' if dm >= 0 else '-'}{_bytes(abs(dm))})")
    if not _same_graph(a, b):
        lines.append(f"the graphs differ ({len(a.nodes)} and {len(b.nodes)} nodes): nodes are compared by name "
                     "where both have them")

    def label(n):
        return strategy_label(n) if n.role == "decision" else _fmt(n.out)

    def differs(name, n):
        m = b.nodes.get(name)
        return m is not None and m.role == n.role and label(m) != label(n)

    blocks = _blocks(a, lambda name, n: _shown(name, n) and differs(name, n))
    shown = sum(len(blk["nodes"]) for blk in blocks)
    other_dec = sum(1 for k, n in a.nodes.items() if n.role == "decision" and not n.tied_to and not _shown(k, n)
                    and differs(k, n))
    params = sum(1 for k, n in a.nodes.items() if n.role == "param" and differs(k, n))
    lines.append(f"matmul-like ops whose strategy differs (distinct ones; tied copies once): {shown}")
    count = 0
    for blk in blocks:
        lines.append("  " + _block_title(blk))
        for name, inner in blk["nodes"]:
            count += 1
            if count > limit:
                break
            lines.append(f"    {inner}  [{name}]:  {label(a.nodes[name])}  ->  {label(b.nodes[name])}")
    if count > limit:
        lines.append(f"  ... and {shown - limit} more")
    lines.append(f"other ops whose strategy differs (norms, elementwise, ...; distinct ones): {other_dec}; "
                 f"parameters whose placement differs: {params}")
    return "\n".join(lines) + "\n"
