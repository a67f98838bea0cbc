"""The planner: an annotated graph becomes a CP-SAT problem, its solution a Plan.

Size control (none of it gives up exactness for the graph as modelled):
  * followers (views, unary elementwise ops) get no variables: their placement
    is a function of their producer's choice (``strategies.follow``);
  * constants (nodes that depend on no input, e.g. RoPE tables) are computed
    locally, replicated, and sliced for free;
  * identical transformer layers are tied: the nodes of layer i > 0 reuse the
    variables of the first layer with the same signature, their costs add up;
  * single-choice groups get no variable (the solver folds them into constants).

Memory per device = parameters + gradients + optimizer state (under their
placements) + activations saved for backward (at the end of forward, where
training peaks) + the largest transient working set of any node.
"""
from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from stpc.cost_models import CostModel, bytes_per_param
from stpc.costs import axis_reshard, dtype_name, local_bytes, node_time, reshard_cost, transient_bytes
from stpc.placement import REPLICATE, shard_factor
from stpc.plan import NodePlan, Plan
from stpc.solver import Edge, Problem, Solution, solve
from stpc.strategies import (SAVES_INPUTS, SAVES_OUTPUT, Strategy, aten, derive, enumerate_strategies,
                             follow, is_follower, is_view_like, op_spec, placement_choices,
                             tensor_operands)
from stpc.trace import TracedGraph

NS = 1e9  # integer costs are nanoseconds

# Ops whose choices are real even with one live operand (the solver keeps them).
_NOT_DERIVED = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
                aten.scaled_dot_product_attention.default, aten.embedding.default,
                aten.cross_entropy_loss.default}

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


class HintUnsatisfiable(ValueError):
    """A hint leaves some node without a strategy on this mesh."""


@dataclass
class Hints:
    """Constraints on the search.

    ``force`` maps a regular expression (matched against a node's name and its
    module path) to a predicate over :class:`Strategy`; matching decision nodes
    keep only the strategies the predicate accepts. ``param_force`` does the
    same for parameters, on their FQN and placement tuple.
    """

    force: list[tuple[str, callable]] = field(default_factory=list)
    param_force: list[tuple[str, callable]] = field(default_factory=list)
    temporal: bool = True
    name: str = ""


@dataclass
class _Group:
    """One set of solver choices, shared by a decision node, its followers and tied copies."""

    rep: fx.Node
    strategies: list             # Strategy per choice (decision) or placement per choice (param/input)
    cost: list[float]            # accumulated over every node sharing the group (tied copies too)
    mem: list[float]
    transient: list[float]
    own_cost: list[float] = field(default_factory=list)  # one copy of the representative node
    own_mem: list[float] = field(default_factory=list)   # one copy of the representative parameter


def layer_of(node: fx.Node) -> int | None:
    key = node.meta.get("param") or node.meta.get("module") or ""
    m = _LAYER.search(key)
    return int(m.group(1)) if m else None


def _signature(node, local_index):
    val = node.meta.get("val")
    shp = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    args = tuple(local_index.get(a, "ext") for a in node.all_input_nodes)
    consts = tuple(a for a in node.args if not isinstance(a, (fx.Node, list, tuple)))
    target = str(node.target) if node.op == "call_function" else ""
    return (node.op, target, shp, args, consts)


def tie_layers(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Map every node of a repeated layer to its representative in the first
    identical layer (same ops, shapes and internal wiring, in order)."""
    layers: dict[int, list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        li = layer_of(n)
        if li is not None:
            layers[li].append(n)
    tie: dict[fx.Node, fx.Node] = {}
    reps: list[tuple[tuple, list[fx.Node]]] = []
    for li in sorted(layers):
        nodes = layers[li]
        idx = {n: i for i, n in enumerate(nodes)}
        sig = tuple(_signature(n, idx) for n in nodes)
        for rsig, rnodes in reps:
            if rsig == sig:
                tie.update(zip(nodes, rnodes))
                break
        else:
            reps.append((sig, nodes))
    return tie


def _requires_grad(graph: fx.Graph, params: set[str]) -> set[fx.Node]:
    rg = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name in params) or any(a in rg for a in n.all_input_nodes):
            rg.add(n)
    return rg


def _constants(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from no placeholder: cheap, replicated, free to slice."""
    const = set()
    for n in graph.nodes:
        if n.op == "call_function" and all(a in const for a in n.all_input_nodes):
            const.add(n)
    return const


def _saved_bases(graph: fx.Graph, rg: set, params: set[str]) -> list[fx.Node]:
    """Tensors kept for backward, as the (non-view) nodes that own their storage."""
    saved = set()
    for n in graph.nodes:
        if n.op != "call_function" or n not in rg:
            continue
        if n.target in SAVES_INPUTS:
            saved.update(o for o in tensor_operands(n) if o.name not in params)
        if n.target in SAVES_OUTPUT:
            saved.add(n)
    bases = {}
    for t in saved:
        while t.op == "call_function" and is_view_like(t) and tensor_operands(t):
            t = tensor_operands(t)[0]
        bases[t] = None
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(bases, key=order.__getitem__)


@dataclass
class GraphFacts:
    """What the planner needs to know about a graph whatever the mesh: computed once
    per traced graph and shared by every mesh shape the search tries."""

    params: set
    rg: set
    const: set
    tie: dict
    saved: list

    @classmethod
    def of(cls, tg: TracedGraph) -> "GraphFacts":
        params = set(tg.param_fqns)
        rg = _requires_grad(tg.graph, params)
        return cls(params, rg, _constants(tg.graph), tie_layers(tg.graph), _saved_bases(tg.graph, rg, params))


class Builder:
    """Turns a TracedGraph into a :class:`Problem` and reads a solution back as a Plan."""

    def __init__(self, tg: TracedGraph, cm: CostModel, hints: Hints | None = None,
                 optimizer_layout: str = "fp32-adam", facts: GraphFacts | None = None):
        self.tg, self.cm, self.hints = tg, cm, hints or Hints()
        self.mesh = cm.mesh_shape
        self.graph = tg.graph
        self.bpp = sum(bytes_per_param(optimizer_layout))
        facts = facts or GraphFacts.of(tg)
        self.params, self.rg, self.const, self.tie = facts.params, facts.rg, facts.const, facts.tie
        self.saved = facts.saved
        self.groups: list[_Group] = []
        self.group_of: dict[fx.Node, int] = {}        # node -> group
        self.place: dict[fx.Node, list] = {}          # node -> output placement per group choice
        self.role: dict[fx.Node, str] = {}
        self.fallback: Counter = Counter()
        self._edge_cache: dict = {}
        self._follow_extra: dict[fx.Node, list[float]] = {}
        self.derived: dict[fx.Node, list[Strategy]] = {}  # node -> strategy per group choice
        self._derive_cache: dict = {}
        self._memo: dict = {}            # (kind, rep, operand reps, group) -> per-choice results
        self._edge_uses: Counter = Counter()  # edge-cache key -> number of tied copies

    # ---------------------------------------------------------------- per node
    def _new_group(self, rep, strategies, cost, mem, transient) -> int:
        self.groups.append(_Group(rep, strategies, np.array(cost, dtype=float), np.array(mem, dtype=float),
                                  list(transient)))
        return len(self.groups) - 1

    def _add(self, g: int, cost=None, mem=None):
        grp = self.groups[g]
        if cost is not None:
            grp.cost += cost
        if mem is not None:
            grp.mem += mem

    def _memo_key(self, kind, node, operands):
        """Tied copies whose operands are tied copies too get identical results."""
        return (kind, self.tie.get(node, node), tuple(self.tie.get(o, o) for o in operands))

    def _hinted(self, node, strategies):
        keys = (node.name, node.meta.get("module", ""))
        for pattern, pred in self.hints.force:
            if any(re.search(pattern, k) for k in keys):
                kept = [s for s in strategies if pred(s)]
                if not kept:
                    raise HintUnsatisfiable(
                        f"hint {pattern!r} leaves node {node.name} ({node.meta.get('source', '')}) with no "
                        f"strategy on mesh {self.mesh}; fix the hint or the mesh shape")
                strategies = kept
        return strategies

    def _placeholder(self, node):
        rep = self.tie.get(node)
        if rep is not None and rep in self.group_of:
            g = self.group_of[rep]
            self.group_of[node], self.place[node], self.role[node] = g, self.place[rep], self.role[rep]
            self._add(g, mem=self.groups[g].own_mem)
            return
        val = node.meta["val"]
        shape = tuple(val.shape)
        if node.name in self.params:
            choices = placement_choices(shape, self.mesh)
            fqn = node.meta.get("param") or ""
            for pattern, pred in self.hints.param_force:
                if re.search(pattern, fqn):
                    choices = [c for c in choices if pred(c)] or choices
            mem = [val.numel() * self.bpp / math.prod(
                n for n, t in zip(self.mesh, p) if t != REPLICATE) for p in choices]
            self.role[node] = "param"
        elif isinstance(val, torch.Tensor):
            # A user input: each rank loads its own shard, so any even split is free.
            choices = placement_choices(shape, self.mesh, grid_weight=False)
            mem = [0.0] * len(choices)
            self.role[node] = "input"
        else:
            return
        g = self._new_group(node, choices, [0.0] * len(choices), mem, [0.0] * len(choices))
        self.groups[g].own_mem = mem
        self.group_of[node] = g
        self.place[node] = choices

    def _decision(self, node):
        rep = self.tie.get(node)
        if rep is not None and rep in self.group_of:
            g = self.group_of[rep]
            self.group_of[node] = g
            self.place[node] = self.place[rep]
            self._add(g, cost=self.groups[g].own_cost)
            return
        strategies, fb = enumerate_strategies(node, self.mesh, temporal=self.hints.temporal)
        if fb:
            self.fallback[str(node.target)] += 1
        strategies = self._hinted(node, strategies)
        ops = tensor_operands(node)
        grads = [o in self.rg for o in ops]
        is_param = [o.name in self.params for o in ops]
        cost = [node_time(node, s, self.cm, grads, is_param) for s in strategies]
        tr = [transient_bytes(node, s, self.mesh) for s in strategies]
        g = self._new_group(node, strategies, [0.0] * len(strategies), [0.0] * len(strategies), tr)
        self.groups[g].own_cost = cost
        self._add(g, cost=cost)
        self.group_of[node] = g
        self.place[node] = [s.out for s in strategies]

    def _derived(self, node, live):
        """A node whose live (non-constant) operands all come from one group — elementwise
        ops with constants, reductions, and ops joining values of one group (RMSNorm's
        x * rsqrt(mean(x^2)), RoPE's halves): its strategy follows from that group's
        choice (``strategies.derive``); where no strategy keeps the operands where they
        are, they are gathered to Replicate first. A modelling restriction, like
        followers: such a node never reshards on its own to please its consumers."""
        ops = tensor_operands(node)
        g = self.group_of[ops[live[0]]]
        memo = self._memo_key("derived", node, [ops[i] for i in live]) + (g,)
        if memo in self._memo:
            self.group_of[node] = g
            self.place[node], self.derived[node], self._follow_extra[node] = self._memo[memo]
            self._add(g, cost=self._follow_extra[node])
            return
        grads = [o in self.rg for o in ops]
        is_param = [o.name in self.params for o in ops]
        rep_p = tuple(REPLICATE for _ in self.mesh)
        strategies, extra = [], []
        cache = {}
        for c in range(len(self.groups[g].cost)):
            key = tuple(self.place[ops[i]][c] for i in live)
            if key not in cache:
                s = derive(node, dict(zip(live, key)), self.mesh, self._derive_cache)
                cost = 0.0
                if s is None:
                    for i, p in zip(live, key):
                        v = ops[i].meta["val"]
                        cost += reshard_cost(self.cm, p, rep_p, v.numel() * v.element_size(),
                                             (False,) * len(self.mesh), ops[i] in self.rg)
                    s = Strategy(out=rep_p, ins=tuple(rep_p for _ in ops))
                cache[key] = (s, cost + node_time(node, s, self.cm, grads, is_param))
            s, cost = cache[key]
            strategies.append(s)
            extra.append(cost)
        self.group_of[node] = g
        self.place[node] = [s.out for s in strategies]
        self.derived[node] = strategies
        self._follow_extra[node] = np.array(extra)
        self._memo[memo] = (self.place[node], strategies, self._follow_extra[node])
        self._add(g, cost=self._follow_extra[node])

    def _follower(self, node):
        (src,) = tensor_operands(node)
        g = self.group_of[src]
        key = self._memo_key("follower", node, [src]) + (g,)
        if key in self._memo:
            self.group_of[node] = g
            self.place[node], self._follow_extra[node] = self._memo[key]
            self._add(g, cost=self._follow_extra[node])
            return
        outs, extra = [], []
        val, sval = node.meta["val"], src.meta["val"]
        rg = node in self.rg
        dt = val.dtype
        for p in self.place[src]:
            q = follow(node, p, self.mesh)
            cost = 0.0
            if q is None:  # cannot keep the layout through this op: gather to Replicate first
                rep_p = tuple(REPLICATE for _ in self.mesh)
                cost += reshard_cost(self.cm, p, rep_p, sval.numel() * sval.element_size(),
                                     (False,) * len(self.mesh), rg)
                q = rep_p
            split = math.prod(n for n, t in zip(self.mesh, q) if t[0] in "SBXW")
            if not is_view_like(node):
                moved = (node.meta["bytes_read"] + node.meta["bytes_written"]) / split
                cost += self.cm.compute(node.meta["flops"] / split, moved * (3 if rg else 1), dtype_name(dt))
            outs.append(q)
            extra.append(cost)
        self.group_of[node] = g
        self.place[node] = outs
        self._follow_extra[node] = np.array(extra)
        self._memo[key] = (outs, self._follow_extra[node])
        self._add(g, cost=self._follow_extra[node])

    # ---------------------------------------------------------------- edges
    def _edges_into(self, node):
        """Resharding costs on the tensor inputs of a decision node.

        The cost of an edge is a sum over mesh axes of a term that depends on the
        producer's whole placement (it sets the bytes) and on the consumer's token
        and split flag on that axis only. So each input edge becomes one solver
        edge per mesh axis, with consumer classes per axis: the class pairs grow
        with the sum, not the product, of the per-axis options.
        """
        v = self.group_of[node]
        rep = self.tie.get(node, node)
        strategies = self.groups[v].strategies
        for i, src in enumerate(tensor_operands(node)):
            if src in self.const or src not in self.group_of:
                continue
            u = self.group_of[src]
            srep = self.tie.get(src, src)
            key = (srep, rep, i, u, v)
            if key not in self._edge_cache:
                self._edge_cache[key] = self._operand_edges(src, strategies, i)
            self._edge_uses[key] += 1

    def _solver_edges(self) -> list[Edge]:
        """One solver edge per (groups, class maps), its table summed over tied copies, in ns."""
        merged: dict[tuple, dict] = {}
        for key, count in self._edge_uses.items():
            u, v = key[3], key[4]
            for ucls, vcls, table in self._edge_cache[key]:
                acc = merged.setdefault((u, v, ucls, vcls), {})
                for k, c in table.items():
                    acc[k] = acc.get(k, 0.0) + c * count
        return [Edge(u, v, ucls, vcls, {k: int(round(c * NS)) for k, c in t.items() if c})
                for (u, v, ucls, vcls), t in merged.items()]

    def _operand_edges(self, src, strategies, i):
        # (Combining the per-axis edges into one transport edge was measured: its tighter
        # LP did not pay for its extra variables on any zoo model.)
        return [e for e in (self._axis_edge(src, strategies, i, a) for a in range(len(self.mesh))) if e[2]]

    def _axis_edge(self, src, strategies, i, a):
        uplace = self.place[src]
        ucls_map: dict = {}
        ucls = tuple(ucls_map.setdefault(p, len(ucls_map)) for p in uplace)
        vcls_map: dict = {}
        vcls = tuple(vcls_map.setdefault((s.ins[i][a], s.split_axes()[a]), len(vcls_map)) for s in strategies)
        val = src.meta["val"]
        nbytes = val.numel() * val.element_size()
        rg = src in self.rg
        table = {}
        for p, pc in ucls_map.items():
            nb = nbytes / shard_factor(p, self.mesh, skip_axis=a)
            for (q, split), qc in vcls_map.items():
                c = axis_reshard(self.cm, a, p[a], q, nb, split, rg)
                if c:
                    table[(pc, qc)] = c
        return _merge_classes(ucls, vcls, table)

    def _live_operands_of_one_group(self, node):
        """Indices of the non-constant tensor operands, if they all belong to one group
        (and the op is elementwise-like: its choices would be no real choice)."""
        if node.target in _NOT_DERIVED or op_spec(node) is None:
            return None
        ops = tensor_operands(node)
        live = [i for i, o in enumerate(ops) if o not in self.const]
        if not live or any(ops[i] not in self.group_of for i in live):
            return None
        if len({self.group_of[ops[i]] for i in live}) != 1:
            return None
        return live

    def _saved_memory(self):
        """Activations kept for backward, charged to the producer of the (base) tensor."""
        uses: Counter = Counter()
        sample = {}
        for t in self.saved:
            if t in self.const or t not in self.group_of or self.role.get(t) == "param":
                continue
            val = t.meta["val"]
            if isinstance(val, torch.Tensor):
                # tied copies share their placement lists: count them, cost one
                key = (self.group_of[t], id(self.place[t]), tuple(val.shape), val.dtype)
                uses[key] += 1
                sample.setdefault(key, t)
        for key, count in uses.items():
            t = sample[key]
            val = t.meta["val"]
            self._add(key[0], mem=count * np.array([local_bytes(val, p, self.mesh) for p in self.place[t]]))

    # ---------------------------------------------------------------- build
    def build(self, budget: float | None) -> Problem:
        self.budget = budget
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            elif node in self.const:
                self.role[node] = "const"
            elif is_follower(node) and tensor_operands(node)[0] in self.group_of:
                self.role[node] = "follower"
                self._follower(node)
            elif (live := self._live_operands_of_one_group(node)) is not None:
                self.role[node] = "derived"
                self._derived(node, live)
            else:
                self.role[node] = "decision"
                self._decision(node)
                self._edges_into(node)
        self._saved_memory()
        return Problem(cost=[np.rint(g.cost * NS).astype(np.int64).tolist() for g in self.groups],
                       mem=[np.rint(g.mem).astype(np.int64).tolist() for g in self.groups],
                       transient=[[int(round(t)) for t in g.transient] for g in self.groups],
                       edges=self._solver_edges(), budget=None if budget is None else int(budget))

    # ---------------------------------------------------------------- read back
    def to_plan(self, choice: list[int], sol, problem: Problem, meta: dict) -> Plan:
        nodes: dict[str, NodePlan] = {}
        edge_s = self._edge_seconds(choice)
        for node in self.graph.nodes:
            if node.op == "placeholder" and node in self.group_of:
                g = self.group_of[node]
                p = self.place[node][choice[g]]
                mem = self.groups[g].own_mem[choice[g]]
                nodes[node.name] = NodePlan(role=self.role[node], op="placeholder", kind="spatial",
                                            out=list(p), mem_bytes=float(mem))
            elif node.op == "call_function" and node in self.role:
                role = self.role[node]
                op = str(getattr(node.target, "__name__", node.target))
                tied = self.tie.get(node)
                if role == "const":
                    nodes[node.name] = NodePlan(role=role, op=op, kind="spatial",
                                                out=[REPLICATE] * len(self.mesh))
                    continue
                g = self.group_of[node]
                c = choice[g]
                if role == "derived":
                    # Planned through its operand; to the passes it is a decision like any other.
                    s = self.derived[node][c]
                    nodes[node.name] = NodePlan(role="decision", op=op, kind=s.kind, out=list(s.out),
                                                ins=[list(p) for p in s.ins], time_s=float(self._follow_extra[node][c]),
                                                tied_to=tied.name if tied else "")
                elif role == "decision":
                    s: Strategy = self.groups[g].strategies[c]
                    own = self.groups[g].own_cost[c]
                    nodes[node.name] = NodePlan(role=role, op=op, kind=s.kind, out=list(s.out),
                                                ins=[list(p) for p in s.ins], axis=s.axis, time_s=own,
                                                comm_s=edge_s.get(self.tie.get(node, node), 0.0),
                                                tied_to=tied.name if tied else "")
                else:
                    extra = float(self._follow_extra[node][c])
                    nodes[node.name] = NodePlan(role=role, op=op, kind="spatial",
                                                out=list(self.place[node][c]), time_s=extra,
                                                tied_to=tied.name if tied else "")
        alts = self._alternatives(choice)
        return Plan(model=self.tg.model_name, mesh_shape=list(self.mesh), cluster=self.cm.cluster.name,
                    dtype=meta.get("dtype", "fp32"), budget_bytes=meta.get("budget"), nodes=nodes,
                    modelled_step_time_s=sol.objective_ns / NS, peak_memory_bytes=float(sol.peak_bytes),
                    stats=meta.get("stats", {}), alternatives=alts)

    def _edge_seconds(self, choice) -> dict:
        """Per representative consumer: modelled seconds of its input edges (one layer's worth)."""
        out = defaultdict(float)
        for (srep, rep, i, u, v), edges in self._edge_cache.items():
            for ucls, vcls, table in edges:
                out[rep] += table.get((ucls[choice[u]], vcls[choice[v]]), 0.0)
        return out

    def _alternatives(self, choice, top: int = 6) -> dict:
        """For each representative decision node: its strategies ranked by node cost plus
        input-edge cost with every neighbour as planned (one copy of the node)."""
        res = {}
        by_consumer = defaultdict(list)
        for (srep, rep, i, u, v), edges in self._edge_cache.items():
            for val in edges:
                by_consumer[rep].append((u, v, val))
        for g, grp in enumerate(self.groups):
            if grp.rep not in self.role or self.role[grp.rep] != "decision" or len(grp.strategies) < 2:
                continue
            scored = []
            for c, s in enumerate(grp.strategies):
                t = grp.own_cost[c]
                for u, v, (ucls, vcls, table) in by_consumer[grp.rep]:
                    uc = c if u == g else choice[u]
                    t += table.get((ucls[uc], vcls[c]), 0.0)
                scored.append((t, s.describe()))
            scored.sort()
            chosen = grp.strategies[choice[g]].describe()
            keep = scored[:top]
            if chosen not in [d for _, d in keep]:
                keep.append(next(x for x in scored if x[1] == chosen))
            res[grp.rep.name] = [(d, t) for t, d in keep]
        return res


def _merge_classes(ucls, vcls, table):
    """Classes whose cost rows (columns) are identical are interchangeable for the solver:
    merge them so the edge has as few class pairs as its costs really distinguish."""
    P, Q = sorted(set(ucls)), sorted(set(vcls))
    rows = {p: tuple(table.get((p, q), 0.0) for q in Q) for p in P}
    rmap = {}
    for p in P:
        rmap[p] = next(p2 for p2 in P if rows[p2] == rows[p])
    cols = {q: tuple(table.get((p, q), 0.0) for p in P) for q in Q}
    cmap = {}
    for q in Q:
        cmap[q] = next(q2 for q2 in Q if cols[q2] == cols[q])
    pr = {p: i for i, p in enumerate(sorted(set(rmap.values())))}
    qr = {q: i for i, q in enumerate(sorted(set(cmap.values())))}
    new_table = {}
    for (p, q), c in table.items():
        new_table[(pr[rmap[p]], qr[cmap[q]])] = c
    return (tuple(pr[rmap[p]] for p in ucls), tuple(qr[cmap[q]] for q in vcls), new_table)


def build_problem(tg: TracedGraph, cm: CostModel, budget: float | None = None, hints: Hints | None = None,
                  optimizer_layout: str = "fp32-adam", facts: GraphFacts | None = None) -> tuple[Builder, Problem]:
    """The solver problem of one traced graph on one mesh shape (``cm.mesh_shape``)."""
    b = Builder(tg, cm, hints, optimizer_layout, facts)
    return b, b.build(budget)


def make_plan(b: Builder, problem: Problem, sol: Solution, build_time_s: float, dtype: str = "fp32") -> Plan:
    """Read a solution of ``b``'s problem back as a Plan, with its solve statistics."""
    stats = {"build_time_s": build_time_s, "solve_time_s": sol.solve_time_s, "status": sol.status,
             "method": sol.method, "num_groups": len(problem.cost), "num_variables": sol.num_variables,
             "num_constraints": sol.num_constraints, "num_nodes": len(b.graph.nodes),
             "tied_nodes": len(b.tie), "fallback_ops": dict(b.fallback), "hints": b.hints.name}
    plan = b.to_plan(sol.choice, sol, problem, {"dtype": dtype, "budget": b.budget, "stats": stats})
    plan.stats["strategy_counts"] = plan.strategy_counts()
    return plan


def plan_graph(tg: TracedGraph, cm: CostModel, budget: float | None = None, hints: Hints | None = None,
               optimizer_layout: str = "fp32-adam", dtype: str = "fp32", cap_s: float | None = None,
               facts: GraphFacts | None = None) -> Plan:
    """Plan one traced graph on one mesh shape (``cm.mesh_shape``). With ``cap_s``,
    raise ``solver.NoBetterPlan`` unless a plan of at most that modelled time exists."""
    t0 = time.perf_counter()
    b, problem = build_problem(tg, cm, budget, hints, optimizer_layout, facts)
    if cap_s is not None:
        problem.cap = int(cap_s * NS)
    t1 = time.perf_counter()
    return make_plan(b, problem, solve(problem), t1 - t0, dtype)
