"""analysis: what the planner knows about a graph before it knows the mesh.

Computed once per traced graph (:func:`analyse`, cached on the TracedGraph) and
shared by every mesh shape the search tries:
  * which nodes need gradients, which are constants, which tensors backward keeps;
  * identical transformer layers tied to their first copy (``tie_layers``);
  * the graph's *work items*. Each node is a parameter, a user input, a
    decision (the solver picks its strategy), a follower (a view or unary op
    whose placement follows its operand) or derived (an op whose live operands
    all come from one group). Nodes with the same role, the same representative
    and operands with the same representatives do the same work on every
    mesh, so they share one :class:`Item` with a count, and a mesh shape costs
    one item once however many layers repeat it;
  * the solver groups (one per parameter, input and untied decision item) and
    the decision inputs that become solver edges, with their counts;
  * tensors several decision nodes read (:class:`SharedRead`): their reshards are
    paid once per distinct placement (``stpc.planner.sharing``). Only star-shaped
    ones are kept (each consumer meets, besides the producer, only its own leaf
    groups and at most one group common to all: q, k, v -> attention), which the
    exact elimination handles; the others stay one edge per consumer (an upper bound:
    a merged reshard charged per consumer);
  * for plans that recompute the layers (``passes.recompute``): which items lie inside a
    recomputed layer and which edges join two ops of one (both replayed in backward), what
    forward then still keeps for backward and what the last layer's replay saves again.
    Where only the first k layers are recomputed (``Hints.recompute_layers``), they are tied
    apart from the others, so an item is replayed in all its copies or in none: the facts
    depend on k (``analyse(tg, k)``).
"""
from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from stpc.frontend.trace import TracedGraph
from stpc.planner.sharing import MAX_CONSUMERS
from stpc.planner.strategies import (SAVES_INPUTS, SAVES_OUTPUT, aten, is_follower, is_view_like, op_spec,
                                     tensor_operands)

# Ops whose choices are real even with one live operand (the solver keeps them).
_NOT_DERIVED = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
                aten.scaled_dot_product_attention.default, aten.embedding.default,
                aten.cross_entropy_loss.default,
                # a norm is a choice of its own, as LayerNorm (with its weights) is: its input
                # may arrive split on the normalised dim, and Hints may name it
                aten.rms_norm.default}

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def layer_of(node: fx.Node) -> int | None:
    key = node.meta.get("param") or node.meta.get("module") or ""
    m = _LAYER.search(key)
    return int(m.group(1)) if m else None


# Selective recomputation (``Hints.recompute == "selective"``, ``passes.recompute``) keeps the
# outputs of the ops below, whose kernel is a matmul or a fused attention, and replays the
# rest of a layer (norms, activations, communication).
_SELECTIVE_KEPT = {aten.linear.default, aten.mm.default, aten.addmm.default,
                   aten.scaled_dot_product_attention.default}
# strategy kinds that run the op as a plain aten call (the others are ring custom ops: replayed)
_PLAIN_KINDS = ("spatial", "replicate-fallback")


def kept_when_selective(node: fx.Node, kind: str = "spatial") -> bool:
    """Whether selective recomputation can keep ``node``'s output instead of replaying it:
    a linear or matmul that runs as one ``mm``/``addmm`` kernel (a 2-D right operand), or a
    scaled dot-product attention (its fused kernel, as CUDA and CPU run it without a mask;
    one that runs as bmm + softmax, on CPU with a float mask or dropout, is replayed: a
    named simplification), run as the plain op (``kind``: its strategy's; a ring's custom
    op is replayed). ``passes.recompute``'s policy keeps the same kernels' outputs."""
    if kind not in _PLAIN_KINDS:
        return False
    if node.target in _SELECTIVE_KEPT:
        return True
    ops = tensor_operands(node)
    if node.target is aten.matmul.default:
        return len(ops) == 2 and ops[0].meta["val"].dim() >= 2 and ops[1].meta["val"].dim() == 2
    return False


_INDEXED_MODULE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def indexed_module(path: str) -> str:
    """A module or parameter path up to its first index (``layers.3.attn.q_proj.weight`` ->
    ``layers.3``), "" outside any indexed module: the unit a ZeRO gather is coalesced by,
    here (``layer_param_bytes``) and at run time (``passes.prefetch_params``)."""
    m = _INDEXED_MODULE.match(path)
    return m.group(1) if m else ""


def layer_param_bytes(graph: fx.Graph) -> dict[fx.Node, float]:
    """Per parameter placeholder inside an indexed module (``layers.3.attn.q_proj.weight``):
    the bytes of all of that module's parameters, the message its ZeRO gather and gradient
    reduce-scatter ride in at run time. Parameters outside one are not in the map (their
    runs of consecutive gathers are charged as messages of their own)."""
    keyed = {}
    for n in graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and n.meta.get("param") and isinstance(val, torch.Tensor):
            key = indexed_module(n.meta["param"])
            if key:
                keyed[n] = (key, val.numel() * val.element_size())
    total = Counter()
    for key, nbytes in keyed.values():
        total[key] += nbytes
    return {n: float(total[key]) for n, (key, _) in keyed.items()}


def _signature(node, local_index):
    val = node.meta.get("val")
    shp = val.shape if isinstance(val, torch.Tensor) else None  # (a torch.Size compares as a tuple)
    args = tuple([local_index.get(a, "ext") for a in node.all_input_nodes])
    consts = tuple([a for a in node.args if not isinstance(a, (fx.Node, list, tuple))])
    target = node.target if node.op == "call_function" else ""  # op overloads compare by identity
    return (node.op, target, shp, args, consts)


def tie_layers(graph: fx.Graph, layer: dict | None = None, apart: set | None = None) -> dict[fx.Node, fx.Node]:
    """Map every node of a repeated layer to its representative in the first
    identical layer (same ops, shapes and internal wiring, in order).
    ``layer``: ``layer_of`` of every node, if already known. ``apart``: layer indices tied
    only among themselves (the recomputed ones, ``Hints.recompute_layers``)."""
    layers: dict[int, list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        li = layer_of(n) if layer is None else layer[n]
        if li is not None:
            layers[li].append(n)
    tie: dict[fx.Node, fx.Node] = {}
    reps: dict[tuple, list[fx.Node]] = {}
    for li in sorted(layers):
        nodes = layers[li]
        idx = {n: i for i, n in enumerate(nodes)}
        sig = (apart is not None and li in apart, tuple([_signature(n, idx) for n in nodes]))
        rnodes = reps.setdefault(sig, nodes)
        if rnodes is not nodes:
            tie.update(zip(nodes, rnodes))
    return tie


def requires_grad(graph: fx.Graph, params: set[str]) -> set[fx.Node]:
    rg = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name in params) or any(a in rg for a in n.all_input_nodes):
            rg.add(n)
    return rg


def constants(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from no placeholder: cheap, replicated, free to slice."""
    const = set()
    for n in graph.nodes:
        if n.op == "call_function" and all(a in const for a in n.all_input_nodes):
            const.add(n)
    return const


def _unneeded_factor(n: fx.Node, ops: list, k: int, rg: set) -> bool:
    """Whether a product's or quotient's operand ``k`` is kept for no gradient (autograd
    saves by ``needs_input_grad``, as ``DivBackward0._saved_self`` shows). ``a * b`` keeps
    ``b`` for ``a``'s gradient and ``a`` for ``b``'s, so each only where the other needs one.
    Rotary embeddings multiply q and k by constant cos and sin tables: they keep the tables,
    not q and k (measured on 4 gloo ranks, llama-tiny under Megatron on 2 x 2: no q, k or
    rotate-half copy alive at the end of forward; the tables are). ``a / b`` keeps ``b`` for
    both gradients and ``a`` only for ``b``'s; by a number (no tensor ``b``), nothing."""
    if n.target is aten.mul.Tensor:
        return not any(o in rg for j, o in enumerate(ops) if j != k)
    if n.target is aten.div.Tensor:
        return k == 0 and not (len(ops) > 1 and ops[1] in rg)
    return False


def saved_savers(graph: fx.Graph, rg: set, params: set[str], operands: dict | None = None) -> dict:
    """Tensors kept for backward, as the nodes that own their storage (views resolved), in
    graph order, each with the set of ops that save it (whose backward reads it: once the
    last of them has run backward, the tensor is freed). ``operands``: ``tensor_operands``
    of every call_function node, if already known."""
    ops = operands if operands is not None else {
        n: tensor_operands(n) for n in graph.nodes if n.op == "call_function"}
    savers: dict = defaultdict(set)
    for n in graph.nodes:
        if n.op != "call_function" or n not in rg:
            continue
        if n.target in SAVES_INPUTS:
            for k, o in enumerate(ops[n]):
                if o.name not in params and not _unneeded_factor(n, ops[n], k, rg):
                    savers[o].add(n)
        if n.target in SAVES_OUTPUT:
            savers[n].add(n)
    bases: dict = defaultdict(set)
    for t, by in savers.items():
        while t.op == "call_function" and is_view_like(t) and ops[t]:
            t = ops[t][0]
        bases[t] |= by
    order = {n: i for i, n in enumerate(graph.nodes)}
    return {t: bases[t] for t in sorted(bases, key=order.__getitem__)}


def saved_bases(graph: fx.Graph, rg: set, params: set[str], operands: dict | None = None) -> list[fx.Node]:
    """Tensors kept for backward, as the nodes that own their storage (views resolved), in
    graph order (``saved_savers``' keys)."""
    return list(saved_savers(graph, rg, params, operands))


def node_signature(node: fx.Node) -> tuple:
    """Everything a strategy or cost computation reads from a node: its op, arguments
    (tensors as shape and dtype), output, FLOPs and bytes. Two nodes with one signature
    have the same strategies and costs on any mesh (for the same operand placements)."""
    def desc(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return ("T", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("N", a.name)
        if isinstance(a, (list, tuple)):
            return tuple(desc(x) for x in a)
        return a
    val = node.meta.get("val")
    return (node.op, node.target, desc(node.args), tuple(sorted((k, desc(v)) for k, v in node.kwargs.items())),
            desc(node) if isinstance(val, torch.Tensor) else None,
            node.meta.get("flops"), node.meta.get("bytes_read"), node.meta.get("bytes_written"))


@dataclass(eq=False)
class Item:
    """One unit of per-mesh work, shared by ``count`` nodes (tied copies)."""

    kind: str                      # param | input | decision | follower | derived
    node: fx.Node                  # the first node doing this work: its shapes and operands
    group: int                     # the solver group it opens (param/input/decision) or joins
    operands: tuple = ()           # per tensor operand: its Item, or None (constant, no group)
    live: tuple = ()               # derived: indices of the live (non-constant) operands
    count: int = 0
    signature: tuple = ()          # ``node_signature`` plus which operands and output need grads


@dataclass(eq=False)
class SharedRead:
    """``count`` producer nodes of item ``src`` whose output the decision operands
    ``uses`` ((consumer Item, operand index), ...) all read."""

    src: Item
    uses: tuple
    count: int


@dataclass
class GraphFacts:
    """The mesh-independent analysis of one traced graph (see the module docstring);
    ``GraphFacts.of(tg)`` computes it, every mesh shape's ``planner.Builder`` reads it."""

    params: set
    rg: set
    const: set
    tie: dict
    items: list[Item]              # in graph order; group-opening items in group order
    node_item: dict                # node -> its Item (every placeholder/op in a group)
    edge_uses: Counter             # (producer Item, decision Item, operand index) -> count, one per consumer
    saved_uses: Counter            # Item owning a tensor kept for backward -> count
    head_saved: Counter = field(default_factory=Counter)  # of those, saved by head ops only -> count
    # of those, saved by one op alone that reads it as an operand: Item -> (that op's Item, operand index)
    sole_saver: dict = field(default_factory=dict)
    # per (Item, saver Item, operand index): how many of the Item's nodes that op alone saves
    # (an Item's copies may have other savers: the last recomputed layer's output is the next,
    # kept layer's norm's to save, the earlier copies the checkpoints' to keep)
    sole_saved: Counter = field(default_factory=Counter)
    # of those, the ops that save it as an operand they read: Item -> {(that op's Item, operand
    # index): [share, share where only head ops save it]}, a node's share 1 / its savers (all
    # of them: its own output or a view saved counts), summed over the Item's nodes
    savers: dict = field(default_factory=dict)
    num_groups: int = 0
    group_items: list = field(default_factory=list)  # group -> the Item that opened it
    shared: list = field(default_factory=list)       # SharedRead: decision inputs paid once per placement
    unshared_reads: int = 0        # producer nodes read by several decisions but charged per consumer
    last_layer: set = field(default_factory=set)  # decision Items of the last layer (``backward_start``)
    head: set = field(default_factory=set)        # decision Items after the last layer (``backward_start``)
    # Under recomputation of the layers (``passes.recompute``, ``recompute_facts``):
    recomputed: frozenset = frozenset()  # the indices of the layers recomputed (all, or the first k)
    recompute_layers: int | None = None  # k where fewer than all: ``Hints.recompute_layers``
    layer_items: set = field(default_factory=set)  # Items of nodes inside a recomputed layer (replayed)
    replayed_edges: set = field(default_factory=set)  # edge_uses keys between two nodes of one such layer
    # decision inputs entering a layer from outside it at its first op, (producer Item, decision
    # Item, operand index) -> count: what a recomputed layer's checkpoint keeps, as that op reads it
    entry_edges: Counter = field(default_factory=Counter)
    kept_saved: Counter = field(default_factory=Counter)  # tensors still kept at the end of forward
    kept_head_saved: Counter = field(default_factory=Counter)  # of those, saved by head ops only
    replay_saved: Counter = field(default_factory=Counter)  # what the last layer's replay saves again

    @classmethod
    def of(cls, tg: TracedGraph, recompute_layers: int | None = None) -> "GraphFacts":
        """``recompute_layers``: the recomputation facts for the first that many layers
        (None, or as many as there are: all of them)."""
        graph = tg.graph
        params = set(tg.param_fqns)
        rg = requires_grad(graph, params)
        layers = sorted({li for n in graph.nodes if (li := layer_of(n)) is not None})
        some = recompute_layers is not None and recompute_layers < len(layers)
        recomputed = frozenset(layers[:recompute_layers] if some else layers)
        f = cls(params, rg, constants(graph), tie_layers(graph, apart=set(recomputed) if some else None),
                [], {}, Counter(), Counter(), recomputed=recomputed, recompute_layers=recompute_layers if some else None)
        f._operands = {n: tensor_operands(n) for n in graph.nodes if n.op == "call_function"}
        f._reads: dict = defaultdict(list)  # operand node -> [(decision Item, operand index)]
        f._items(graph)
        f._share_reads()
        f.last_layer, f.head = backward_start(graph, f.items, f.node_item)
        head_nodes = after_last_layer(graph)
        for t, by in saved_savers(graph, rg, params, f._operands).items():
            it = f.node_item.get(t)
            if it is not None and it.kind != "param" and isinstance(t.meta["val"], torch.Tensor):
                f.saved_uses[it] += 1
                if by <= head_nodes:  # freed by the head's backward, before the last layer's began
                    f.head_saved[it] += 1
                shares = f.savers.setdefault(it, {})
                for s in sorted(by, key=lambda s: s.name):  # (one order on every rank: shares are rounded in it)
                    i = f.saved_operand(s, t)
                    if i is not None and f.node_item.get(s) is not None:
                        share = shares.setdefault((f.node_item[s], i), [0.0, 0.0])
                        share[0] += 1 / len(by)
                        share[1] += (by <= head_nodes) / len(by)
                saver = next(iter(by))
                if len(by) == 1 and t in f._operands.get(saver, ()) and f.node_item.get(saver) is not None:
                    f.sole_saver[it] = (f.node_item[saver], f._operands[saver].index(t))
                    f.sole_saved[(it, *f.sole_saver[it])] += 1
        f._recompute_facts(graph, head_nodes)
        return f

    def saved_operand(self, saver: fx.Node, t: fx.Node) -> int | None:
        """The index of ``saver``'s operand that is ``t`` or a view of it (a chain of views:
        the loss reads the head's logits through a reshape, attention its q, k, v through a
        view and a transpose); None if none is. The saver keeps that operand as it reads
        it: where it reads it through a reshard, the reshard's output."""
        for i, o in enumerate(self._operands.get(saver, ())):
            while o is not t and o.op == "call_function" and is_view_like(o) and self._operands.get(o):
                o = self._operands[o][0]
            if o is t:
                return i
        return None

    def joint_savers(self, it: Item) -> list[Item] | None:
        """The ops that save ``it`` together, in ``savers`` order, where each could keep its
        own blocks of it instead (``Builder._shared_saved_edges``): n >= 2 decision ops of
        distinct groups, none ``it``'s own, every one reading it as an operand, in equal
        shares (no copies of it in tied layers saved by different ops), and not the head's
        alone. None otherwise (then each saver's part of it stays charged)."""
        count = self.saved_uses[it]
        shares = self.savers.get(it, {})
        if not count or self.head_saved[it] or it in self.sole_saver or len(shares) < 2:
            return None
        savers = [saver for saver, _ in shares]
        groups = {saver.group for saver in savers}
        if (len(groups) != len(savers) or it.group in groups or any(saver.kind != "decision" for saver in savers)
                or any(abs(share - count / len(savers)) > 1e-9 for share, _ in shares.values())):
            return None
        return savers

    def _recompute_facts(self, graph, head_nodes):
        """What a plan that recomputes the layers (``passes.recompute``; those of
        ``self.recomputed``) keeps from forward to backward: the tensors an op outside them
        saves, and each recomputed layer's inputs from outside it (what the checkpoint holds:
        the residual stream entering it), as the nodes owning their storage; and what the last
        layer's replay saves again, alive in its backward (the memory model's backward phase;
        none where the last layer is not recomputed)."""
        rec = self.recomputed
        layer = {n: (li if (li := layer_of(n)) in rec else None) for n in graph.nodes}  # (recomputed ones only)
        last, _ = _last_layer(graph)
        savers = saved_savers(graph, self.rg, self.params, self._operands)
        boundary = set()
        for n in graph.nodes:
            if n.op != "call_function" or layer[n] is None:
                continue
            for o in self._operands[n]:
                if layer[o] == layer[n] or o.op != "call_function" or o in self.const:
                    continue
                while is_view_like(o) and self._operands.get(o):
                    o = self._operands[o][0]
                boundary.add(o)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for t in sorted(set(savers) | boundary, key=order.__getitem__):
            it = self.node_item.get(t)
            if it is None or it.kind == "param" or not isinstance(t.meta["val"], torch.Tensor):
                continue
            by = savers.get(t, set())
            if t in boundary or any(layer[b] is None for b in by):
                self.kept_saved[it] += 1
                if by and by <= head_nodes:
                    self.kept_head_saved[it] += 1
            elif last is not None and any(layer[b] == last for b in by):
                self.replay_saved[it] += 1
        self.layer_items = {it for n, it in self.node_item.items() if layer[n] is not None and n.op != "placeholder"}
        assert not any(layer[n] is None for n, it in self.node_item.items() if it in self.layer_items
                       and n.op != "placeholder"), "a recomputed layer's item is tied to a kept layer's"

    def _rep(self, node):
        return self.tie.get(node, node)

    def _items(self, graph):
        memo: dict[tuple, Item] = {}
        self._has_spec: dict = {}
        # each layer's first op: a reshard into it sits before the layer's span, outside it
        # (``passes.recompute``); one into a later op of the layer sits inside
        firsts = {}
        for node in graph.nodes:
            if node.op == "call_function" and (li := layer_of(node)) in self.recomputed:
                firsts.setdefault(li, node)
        first_ops = set(firsts.values())

        def use(key, make):
            it = memo.get(key)
            if it is None:
                it = memo[key] = make()
                if it.kind != "param" and it.kind != "input":
                    ops = self._operands[it.node]
                    it.signature = (node_signature(it.node), it.node in self.rg, tuple(o in self.rg for o in ops))
                self.items.append(it)
                if it.kind in ("param", "input", "decision"):
                    self.num_groups += 1
                    self.group_items.append(it)
            it.count += 1
            return it

        for node in graph.nodes:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or node in self.const:
                continue
            if node.op == "placeholder":
                kind = "param" if node.name in self.params else "input"
                it = use((kind, self._rep(node)), lambda: Item(kind, node, self.num_groups))
            elif node.op != "call_function":
                continue
            else:
                ops = self._operands[node]
                opi = tuple(self.node_item.get(o) if o not in self.const else None for o in ops)
                if is_follower(node, ops) and opi[0] is not None:
                    src = opi[0]
                    it = use(("follower", self._rep(node), src),
                             lambda: Item("follower", node, src.group, opi))
                elif (live := self._one_group(node, opi)) is not None:
                    it = use(("derived", self._rep(node), tuple(opi[i] for i in live)),
                             lambda: Item("derived", node, opi[live[0]].group, opi, live))
                else:
                    it = use(("decision", self._rep(node)),
                             lambda: Item("decision", node, self.num_groups, opi))
                    for i, src in enumerate(opi):
                        if src is not None:
                            self.edge_uses[(src, it, i)] += 1
                            if (li := layer_of(node)) in self.recomputed and layer_of(ops[i]) == li:
                                self.replayed_edges.add((src, it, i))
                            elif src.kind != "param" and node in first_ops:
                                self.entry_edges[(src, it, i)] += 1
                            self._reads[ops[i]].append((it, i))
            self.node_item[node] = it

    def _share_reads(self):
        """Move the star-shaped shared reads (module docstring) out of ``edge_uses`` into
        ``shared``. Which groups touch which is a property of the graph alone."""
        sets = Counter()
        for o, uses in self._reads.items():
            if len(uses) > 1:
                sets[(self.node_item[o], tuple(sorted(uses, key=lambda u: (u[0].group, u[1]))))] += 1
        adj = defaultdict(set)
        for src, dst, _ in self.edge_uses:
            if src.group != dst.group:
                adj[src.group].add(dst.group)
                adj[dst.group].add(src.group)
        taken: set = set()
        for (src, uses), count in sets.items():
            u, vs = src.group, [d.group for d, _ in uses]
            # (a parameter's edges overlap their consumer's compute, ``cost_models.overlap``: a
            # share has no consumer of its own to overlap with, so parameters keep their edges)
            ok = (len(set(vs)) == len(vs) <= MAX_CONSUMERS and u not in vs and not taken & {u, *vs}
                  and self.group_items[u].kind != "param" and self._is_star(u, vs, adj, src, uses, count))
            if not ok:
                self.unshared_reads += count
                continue
            taken |= {u, *vs}
            self.shared.append(SharedRead(src, uses, count))
            for d, i in uses:
                self.edge_uses[(src, d, i)] -= count
                if not self.edge_uses[(src, d, i)]:
                    del self.edge_uses[(src, d, i)]

    def _is_star(self, u, vs, adj, src, uses, count) -> bool:
        """Each consumer meets the producer only through this read, and otherwise only its
        own leaves and at most one group common to all consumers."""
        mine = set(uses)
        for (a, b, i), c in self.edge_uses.items():
            if {a.group, b.group} & {u} and {a.group, b.group} & set(vs):
                if not (a is src and (b, i) in mine and c == count):
                    return False
        common = set()
        for v in vs:
            leaves = {g for g in adj[v] if adj[g] == {v}}
            common |= adj[v] - leaves - {u}
        return len(common) <= 1 and not common & {u, *vs}

    def _one_group(self, node, opi):
        """Indices of the live (non-constant) operands, if they all belong to one group
        (and the op is elementwise-like: its choices would be no real choice)."""
        if node.target in _NOT_DERIVED:
            return None
        rep = self._rep(node)  # tied copies have the same shapes: ask op_spec once
        if rep not in self._has_spec:
            self._has_spec[rep] = op_spec(rep) is not None
        if not self._has_spec[rep]:
            return None
        live = tuple(i for i, o in enumerate(self._operands[node]) if o not in self.const)
        if not live or any(opi[i] is None for i in live) or len({opi[i].group for i in live}) != 1:
            return None
        return live


def analyse(tg: TracedGraph, recompute_layers: int | None = None) -> GraphFacts:
    """The graph's mesh-independent facts, computed once and reused by every mesh shape
    and every search (cached in ``tg.facts``; ``tg.meta["analysis_s"]`` says how long it
    took); recomputed when the graph changed (its node count or its recompiled code:
    every stpc pass lints and recompiles). ``recompute_layers``: the facts of plans that
    recompute only the first that many layers (``Hints.recompute_layers``), cached beside."""
    key = (len(tg.gm.graph.nodes), tg.gm.code)
    if tg.facts is None or tg.meta.get("analysed") != key:
        t0 = time.perf_counter()
        tg.facts = GraphFacts.of(tg)
        tg.meta["analysis_s"] = time.perf_counter() - t0
        tg.meta["analysed"] = key
        tg.meta["facts_recomputing"] = {}
    if recompute_layers is None:
        return tg.facts
    by_count = tg.meta.setdefault("facts_recomputing", {})
    if recompute_layers not in by_count:
        facts = GraphFacts.of(tg, recompute_layers)
        by_count[recompute_layers] = tg.facts if facts.recompute_layers is None else facts  # (k >= the layers: all)
    return by_count[recompute_layers]


def _last_layer(graph: fx.Graph) -> tuple[int | None, int]:
    """(the last repeated layer's index, the graph position of its last node); (None, -1)
    for a graph without indexed layers."""
    last_layer, last_pos = None, -1
    for k, n in enumerate(graph.nodes):
        layer = layer_of(n)
        if layer is not None and (last_layer is None or layer >= last_layer):
            last_layer, last_pos = layer, k
    return last_layer, last_pos


def after_last_layer(graph: fx.Graph) -> set:
    """The nodes of the head: after the last repeated layer's last node in graph order, and
    in no layer (final norm, output projection, loss). Empty for a graph without indexed
    layers."""
    last_layer, last_pos = _last_layer(graph)
    if last_layer is None:
        return set()
    return {n for n in list(graph.nodes)[last_pos + 1:] if layer_of(n) is None}


def backward_start(graph: fx.Graph, items: list[Item], node_item: dict) -> tuple[set, set]:
    """(the last layer's decision Items, the head's) — the ops backward runs first, while
    everything forward saved is still alive: the head (:func:`after_last_layer`: final
    norm, output projection, loss), then the last layer (an Item tied across the layers
    stands for its copy there). Their gradients and the parameters gathered again for
    them make the memory model's backward phase. A graph without indexed layers is one
    layer: all its decision Items, no head. ``node_item`` (every node's Item): the last
    layer's are those of its own nodes (layers tied apart, ``tie_layers``, share none)."""
    last_layer, _ = _last_layer(graph)
    head_nodes = after_last_layer(graph)
    in_last = {it for n, it in node_item.items() if layer_of(n) == last_layer}
    last, head = set(), set()
    for it in items:
        if it.kind != "decision":
            continue
        if last_layer is None or it in in_last:
            last.add(it)
        elif it.node in head_nodes:
            head.add(it)
    return last, head


__all__ = ["analyse", "GraphFacts", "Item", "SharedRead", "node_signature", "tie_layers", "layer_of", "kept_when_selective", "backward_start", "requires_grad", "constants", "saved_bases", "saved_savers", "after_last_layer",
           "layer_param_bytes", "indexed_module"]
