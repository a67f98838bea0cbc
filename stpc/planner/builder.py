"""builder: an analysed graph becomes a solver problem on one mesh shape, its solution a Plan.

Size control (none of it gives up exactness for the graph as modelled):
  * followers (views, unary elementwise ops) get no variables: their placement
    is a function of their producer's choice (``strategies.follow``; where they cannot
    keep it, of the nearest placement they can keep, ``_nearest_followable``);
  * constants (nodes that depend on no input, e.g. RoPE tables) are computed
    locally, replicated, and sliced for free;
  * identical transformer layers are tied: the nodes of layer i > 0 reuse the
    choices of the first layer with the same signature, their costs add up;
  * nodes that do the same work on every mesh share one work item
    (``stpc.planner.analysis``): a mesh shape costs each item once, times its count.

Memory per device is ``cost_models.MemoryModel``'s, the largest of four phases: at the
end of forward, weights + optimizer state (under their placements; gradients only where
the trainer keeps them through forward) + activations saved for backward (and the blocks
a P(2^k x 2^k) op keeps for its backward, ``costs.stash_bytes``) + the largest transient
working set of any node (the loss's is its backward's, ``costs.WORKING_COPIES``, one logits
copy more where the logits reach it resharded, ``_transient_edges``; a head
op's, the gradients its backward computes, ``costs.grad_bytes``, or a P(2^k x 2^k) op's
backward ring buffers, ``costs.ring_backward_bytes``, if larger); while the
head's gradients are reduced, the same less what only the head saved and the whole copies
of its weights kept for it (ZeRO-2), + the head's weight gradients as computed
(``_Group.head_mem``) + the buffers reducing them (``_head_reduction_edges``); in the
last layer's backward, the same saved activations less those only the head's ops saved
(its backward, which ran first, freed them: ``GraphFacts.head_saved``, taken off
``_Group.bwd_mem``) and state + the largest working set of that layer's own ops (the loss's
and the head's ended before it began; ``_Group.bwd_transient``) + the gradients of the head's parameters and of
the last layer's weights (``_Group.bwd_mem``) + the ZeRO-3 weights gathered again for it
(``_regather_edges``, memory edges), less the head's kept weights; in the optimizer step, weights
+ gradients + optimizer state + the optimizer's scratch (``MemoryModel.step_scratch``), a phase
that holds the end of backward too (every gradient made, the last summed one twice for a moment).

Under ``Hints.recompute == "full"`` (``passes.recompute``: every layer's forward replayed
in backward) an op inside a layer also pays its forward again (``NodeTimer.forward``;
a reshard between two ops of one layer its forward collective again; a ZeRO gather into
a layer's op whole and blocking), the end of forward keeps only what ops outside the
layers save and the layers' inputs (``GraphFacts.kept_saved``), and the last layer's
backward holds what its replay saves again (``replay_saved``) and its ops' own blocks.
Under ``"selective"`` the same, except that a layer's plain matmuls and fused attentions
whose outputs backward keeps anyway (``analysis.kept_when_selective``) keep their local
outputs from forward to backward instead of running again (``Builder._selective_kept``),
and the last layer's replay saves no second copy of them (``_saved_memory``).
With ``Hints.recompute_layers`` = k only the first k layers are: they are tied apart from
the others (``analysis.tie_layers``), so each item is replayed in all its copies or none,
and a layer that is not recomputed keeps what its ops save, as without recomputation.
The replay of the last recomputed layer is then no phase of its own (named
simplification): by the time backward reaches it, the later layers' saved activations are
freed, at least one layer's worth; but the two kinds of layer choose their strategies
apart, and where the recomputed ones take a less sharded layout than the kept ones, that
replay can hold more than the kept layers freed, unseen by the model (the fidelity bench's
plan ``partial``: 353.7 MiB modelled, 357.8 measured). A ``Hints.force`` pattern naming
one layer's nodes (such as ``layers.0.``) decides the layers tied to it: the recomputed ones,
no longer the others.

Resharding is costed on the inputs of decision nodes: one solver edge per consumer,
except where several consumers read one tensor (``GraphFacts.shared``): a
``sharing.Share`` then pays each distinct placement they need once, as ``cleanup``
merges the identical reshards at run time.
"""
from __future__ import annotations

import itertools
import math
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from stpc.cost_models import (CostModel, MemoryModel, bytes_per_param, keeps_grad_buckets,
                              optimizer_step_time)
from stpc.frontend.trace import TracedGraph
from stpc.placement import REPLICATE, fits, shard, shard_factor
from stpc.planner import grad_sum
from stpc.planner.analysis import GraphFacts, Item, analyse, kept_when_selective, layer_of, layer_param_bytes
from stpc.planner.costs import (RESHARD_COPIES, NodeTimer, axis_reshard, axis_reshard_phases, dtype_name, grad_bytes,
                               grad_reduction_bytes, grid_relayout_s, kept_gathered_bytes, param_copy_phases,
                               reshard_cost, ring_backward_bytes, slowdown_key, stash_bytes, transient_bytes)
from stpc.planner.hints import HintUnsatisfiable, Hints, sequence_parallel_nodes
from stpc.planner.plan import NodePlan, Plan
from stpc.planner.sharing import Share
from stpc.planner.solver import Edge, Problem, Solution, solve
from stpc.planner.strategies import (SAVES_INPUTS, Strategy, aten, derive, enumerate_strategies, follow_rule,
                                     is_view_like, placement_choices, tensor_operands)

NS = 1e9  # integer costs are nanoseconds


def _split(p: tuple) -> bool:
    """Whether placement ``p`` splits the tensor on some axis (not all Replicate)."""
    return any(t != REPLICATE for t in p)


def _dual_holds_no_copy(p: tuple, q: tuple) -> bool:
    """Whether the reshard ``p`` -> ``q``'s dual in backward holds no gradient copy beyond
    the reader's own: on every axis where they differ, either the read is Replicate (a
    gather, or an all-reduce of a Partial: its dual slices the gradient where it is, or
    passes it on) or one plain split becomes another (an all-to-all: the runtime frees each
    exchange's send buffer once done). A grid layout or a Partial read split is an exchange
    whose dual holds the gradient's buffers."""
    return all(a == b or b == REPLICATE or (a[0] == "S" and b[0] == "S") for a, b in zip(p, q))

@dataclass
class _Group:
    """One set of solver choices, shared by a decision node, its followers and tied copies."""

    strategies: list             # Strategy per choice (decision) or placement per choice (param/input)
    cost: np.ndarray             # accumulated over every node sharing the group (tied copies too)
    mem: np.ndarray
    transient: list[float]
    own_cost: list[float] = field(default_factory=list)  # one copy of the representative node
    own_mem: list[float] = field(default_factory=list)   # one copy of the representative parameter
    step_mem: np.ndarray | None = None  # bytes alive in the optimizer step (a parameter's state + scratch)
    step_transient: list[float] | None = None  # scratch alive while its own parameter steps (max)
    bwd_mem: np.ndarray | None = None  # the last layer's backward beyond the end of forward (one copy)
    bwd_transient: list[float] | None = None  # its working set in that phase (a last-layer op's; else 0)
    head_mem: np.ndarray | None = None  # the head's gradient reduction beyond the end of forward (one copy)


class _Readers(NamedTuple):
    """A parameter several ops read, as ``grad_sum`` sees it."""

    count: int         # how many reads
    pen_bytes: float   # the most bytes one of them moves whole: what sizes the penalty
    # whether their ZeRO gathers are one call: every read of one node, none inside a
    # recomputed layer (whose gathers stay its own)
    gathers: bool
    # whether any of them outside the head keeps it for backward: a gather they share is then
    # made again (unless a head op reads it too, for which it is kept from forward, as
    # ``prefetch_params`` keeps the head's: charged again then, an over-charge)
    saved: bool


class Builder:
    """Turns a TracedGraph into a :class:`Problem` on one mesh shape and reads a
    solution back as a Plan. Works on the graph's work items (``stpc.planner.analysis``):
    each is costed once and counted as often as nodes share it."""

    def __init__(self, tg: TracedGraph, cm: CostModel, hints: Hints | None = None,
                 memory: MemoryModel | str = "fp32-adam", facts: GraphFacts | None = None):
        self.tg, self.cm, self.hints = tg, cm, hints or Hints()
        self.mesh = cm.mesh_shape
        self.graph = tg.graph
        # (a layout name: that layout's state, stepped by foreach AdamW)
        self.memory = memory if isinstance(memory, MemoryModel) else MemoryModel(memory)
        if self.memory.kept_buckets is None:  # (as the device's allocator calls for; no buckets, none kept)
            self.memory = replace(self.memory, kept_buckets=keeps_grad_buckets(cm.device)
                                  and self.memory.grad_bucket_bytes is not None)
        # the message a data-parallel gradient's sum rides in (0: one of its own, waited where made)
        self.bucket_bytes = float(self.memory.grad_bucket_bytes or 0.0)
        # (only the first k layers recomputed: their own facts, those layers tied apart)
        k = self.hints.recompute_layers if self.hints.recompute in ("full", "selective") else None
        self.facts = analyse(tg, k) if k is not None else facts or analyse(tg)
        self.params, self.rg, self.const, self.tie = (self.facts.params, self.facts.rg, self.facts.const,
                                                      self.facts.tie)
        self.groups: list[_Group] = []
        self.place: dict[Item, list] = {}       # item -> output placement per group choice
        self.extra: dict[Item, np.ndarray] = {}  # follower/derived item -> seconds per group choice
        self.follow_via: dict[Item, list] = {}   # follower item -> the input placement it reads, per choice
        self.derived: dict[Item, list[Strategy]] = {}  # derived item -> strategy per group choice
        self.fallback: Counter = Counter()
        self._edge_cache: dict = {}             # (producer, consumer, operand) -> per-axis edges
        self._share_costs: list = []            # per SharedRead: (seconds per producer choice and key,
                                                #   key per choice of each consumer)
        self._item_order: dict | None = None    # item -> its place in graph order (read-back)
        self.timers: dict[int, NodeTimer] = {}  # decision group -> its node's timer (overlap windows)
        # decision item -> per strategy, per axis the compute its forward ends after the ranks
        # met there (``NodeTimer.meeting_tail``); only items where some strategy has one
        self.meets: dict = {}
        self._choice_lists: dict = {}           # placement choices by content: one list object each
        # Answers that depend on the cost model and their keys alone, kept in its memo for
        # every problem built on it (a search's families and hints on one mesh shape:
        # ``CostModel.memo``)
        memo = cm.memo.setdefault("builder", {})
        self._derive_cache: dict = memo.setdefault("derive", {})
        self._enum_cache: dict = memo.setdefault("enumerate", {})  # strategies by op spec and divisibility
        self._reshard: dict = memo.setdefault("axis_reshard", {})  # axis_reshard by its arguments
        self._reshard_phases: dict = memo.setdefault("axis_reshard_phases", {})  # ... and its phases
        self._axis_tables: dict = memo.setdefault("axis_tables", {})  # per-axis class keys -> merged table
        self._by_key: dict = memo.setdefault("by_key", {})  # derived/follower answers per signature and input
        self._shared: dict = {}                 # results shared by items of one signature
        self._axis_keys: dict = {}              # placement -> per-axis producer class key
        self.budget = None
        self.head_params = {src for src, dst, _ in self.facts.edge_uses if dst in self.facts.head}
        self._last_layer_params = {src for src, dst, _ in self.facts.edge_uses if dst in self.facts.last_layer}
        # head parameters no op outside the head keeps for its backward (an embedding reading
        # a tied one saves only its indices)
        self._freed_by_head = self.head_params - {
            src for src, dst, i in self.facts.edge_uses if dst not in self.facts.head
            and dst.node.target in SAVES_INPUTS and not (dst.node.target is aten.embedding.default and i == 0)}
        self._sp_nodes = sequence_parallel_nodes(self.graph) if self.hints.sequence_parallel is not None else set()
        # (selective recomputation is full recomputation less the replay of the matmuls and
        # fused attentions it keeps the outputs of: ``analysis.kept_when_selective``)
        self.recompute = self.hints.recompute in ("full", "selective")
        self.selective = self.hints.recompute == "selective"
        self._tied_copies = self.tg.tied_copies()
        # every name of a tied parameter (its readers' gradients are summed: ``MemoryModel.step_scratch``)
        self._tied_names = set(self.tg.tied_params) | set(self.tg.tied_params.values())
        self._force_hits: set[int] = set()  # the Hints.force patterns that matched a decision node
        self._layer_bytes = layer_param_bytes(self.graph)
        # a parameter several ops read: its reads in forward order, its modes per choice (``grad_sum``)
        self._unsaved_embedding = self._embedding_group_unsaved()
        self._reader_of, self._readers = self._param_readers()
        self._sum_modes: dict[int, list] = {}   # such a parameter's group -> its mode per choice

    def _embedding_group_unsaved(self) -> bool:
        """Whether an embedding's gathered table is left out of backward at run time: its
        backward keeps the indices, not the table, so ``RegatherSaved`` gathers it again only
        if another parameter of its coalesced group is kept (``prefetch_params`` groups the
        gathers before the first layer as one run: BLOOM's embedding norm joins the table).
        So: no parameter read before the first layer by an op that keeps its operands for
        backward, other than an embedding's table."""
        order = {n: k for k, n in enumerate(self.graph.nodes)}
        first = min((order[n] for n in self.graph.nodes if n.op == "call_function" and layer_of(n) is not None),
                    default=len(order))
        for n in self.graph.nodes:
            if n.op == "call_function" and order[n] < first and n.target in SAVES_INPUTS:
                for i, o in enumerate(tensor_operands(n)):
                    if self.facts.node_item.get(o) is not None and self.facts.node_item[o].kind == "param" and not (
                            n.target is aten.embedding.default and i == 0):
                        return False
        return True

    def _saves(self, node, i: int) -> bool:
        """Whether op ``node``'s ZeRO-3 gather of its operand i (a parameter) is made again in
        backward: always, but an embedding's table where :meth:`_embedding_group_unsaved` (a
        layer's gathers are made again as a group as soon as one of them is kept, and every
        layer keeps its matmuls' weights)."""
        return not (node.target is aten.embedding.default and i == 0 and self._unsaved_embedding)

    def _param_readers(self) -> tuple[dict, dict]:
        """Parameters that more than one op reads (through their group: a view or cast of one
        reads it too), as ``grad_sum`` sees them: (read (src, dst, i) -> its place in forward
        order among its parameter's reads, group -> its :class:`_Readers`)."""
        reads = defaultdict(set)
        for src, dst, i in self.facts.edge_uses:
            if self.facts.group_items[src.group].kind == "param" and src.group != dst.group:
                reads[src.group].add((src, dst, i))
        order, readers = {}, {}
        for g, rs in reads.items():
            if len(rs) > 1:
                for k, r in enumerate(sorted(rs, key=lambda r: (self._order(r[1]), r[2]))):
                    order[r] = k
                gathers = (len({src.node for src, _, _ in rs}) == 1
                           and not (self.recompute and any(dst in self.facts.layer_items for _, dst, _ in rs)))
                readers[g] = _Readers(
                    len(rs), max(r[0].node.meta["val"].numel() * r[0].node.meta["val"].element_size() for r in rs),
                    gathers, any(self._saves(dst.node, i) for _, dst, i in rs if dst not in self.facts.head))
        return order, readers

    # ---------------------------------------------------------------- per item
    def _open_group(self, it: Item, strategies, cost, mem, transient, step=None, own_mem=None):
        assert it.group == len(self.groups)
        step_mem, step_tr = step if step is not None else (np.zeros(len(cost)), [0.0] * len(cost))
        self.groups.append(_Group(strategies, np.array(cost, dtype=float) * it.count,
                                  np.array(mem, dtype=float) * it.count, list(transient),
                                  own_cost=list(cost), own_mem=list(mem if own_mem is None else own_mem),
                                  step_mem=np.asarray(step_mem, dtype=float) * it.count, step_transient=list(step_tr),
                                  bwd_mem=np.zeros(len(cost)), head_mem=np.zeros(len(cost))))

    def _hinted(self, node, strategies):
        sp = self.hints.sequence_parallel
        if sp is not None and self.mesh[sp] > 1 and node.name in self._sp_nodes:
            kept = [s for s in strategies if s.out[sp] == "S1"]
            if not kept:
                raise HintUnsatisfiable(
                    f"sequence parallelism on mesh axis {sp} needs node {node.name} ({node.meta.get('source', '')}) "
                    f"split on its sequence (dim 1) there, and none of its strategies on mesh {self.mesh} is; "
                    f"fix: a sequence length that divides by {self.mesh[sp]}, or sequence_parallel=False")
            strategies = kept
        keys = (node.name, node.meta.get("module", ""))
        for k_pat, (pattern, pred) in enumerate(self.hints.force):
            if any(re.search(pattern, k) for k in keys):
                self._force_hits.add(k_pat)
                kept = [s for s in strategies if pred(s)]
                if not kept:
                    raise HintUnsatisfiable(
                        f"hint {pattern!r} leaves node {node.name} ({node.meta.get('source', '')}) with no "
                        f"strategy on mesh {self.mesh}; fix the hint or the mesh shape")
                strategies = kept
        return strategies

    def _placeholder(self, it: Item):
        node = it.node
        val = node.meta["val"]
        shape = tuple(val.shape)
        step = own_mem = None  # (the optimizer step's bytes, a parameter's whole state: parameters only)
        kept = None
        if it.kind == "param":
            choices = placement_choices(shape, self.mesh)
            fqn = node.meta.get("param") or ""
            for pattern, pred in self.hints.param_force:
                if re.search(pattern, fqn):
                    choices = [c for c in choices if pred(c)] or choices
            if fqn in self.hints.param_exact:
                choices = self._exact(node, f"parameter {fqn}", choices, self.hints.param_exact[fqn])
            if it.group in self._readers and node in self.rg:  # each placement once per mode (``grad_sum``)
                rd = self._readers[it.group]
                with_modes = [(p, m) for p in choices for m in grad_sum.modes(p, self.mesh, rd.count, rd.gathers)]
                choices = [p for p, _ in with_modes]
                self._sum_modes[it.group] = [m for _, m in with_modes]
            else:
                choices = self._choice_lists.setdefault(tuple(choices), choices)  # (equal lists: one object)
            cost = [0.0] * len(choices)
            shards = [math.prod(n for n, t in zip(self.mesh, p) if t != REPLICATE) for p in choices]
            if node.name in self._tied_copies:  # the same tensor as another parameter: held once, as read
                mem = [0.0] * len(choices)
            else:
                mem = [self.memory.param_bytes(val.numel(), w) for w in shards]
                if node in self.rg:  # the optimizer steps the elements this device holds the state of
                    cost = [optimizer_step_time(self.cm.device, val.numel() / w, self.memory.layout,
                                                 self.memory.optimizer_impl) for w in shards]
                    # ... with its scratch beside the whole state (``MemoryModel.step_scratch``)
                    # (and at backward's end a reduced gradient's second copy: replicated on an axis;
                    # a tied one's readers' two gradients beside their sum)
                    scratch = [self.memory.step_scratch(val.numel() / w, any(
                        t == REPLICATE and n > 1 for t, n in zip(p, self.mesh)), node.name in self._tied_names)
                               for p, w in zip(choices, shards)]
                    step = ([m + s for m, (s, _) in zip(mem, scratch)], [t for _, t in scratch])
                else:
                    step = (mem, [0.0] * len(choices))
                # ZeRO-2: the whole weight gathered in forward is kept for backward (not in the step)
                # (a recomputed layer's weights are gathered again by its replay: none kept)
                kept = [0.0 if self.recompute and layer_of(node) in self.facts.recomputed else
                        kept_gathered_bytes(val, p, self.mesh, self.hints.keep_gathered) for p in choices]
                own_mem = [m + k for m, k in zip(mem, kept)]  # (what NodePlan.mem_bytes reports)
                # (a gradient summed over ranks, where the runtime keeps its bucket: held through forward)
                mem = [self.memory.forward_param_bytes(val.numel(), w, self._bucketed(node, p)) + k
                       for p, w, k in zip(choices, shards, kept)]
            # a skewed grid weight is stored as plain blocks and relaid each step (a tied copy's too:
            # the feed relays every placeholder planned so)
            nbytes = val.numel() * val.element_size()
            cost = [c + grid_relayout_s(self.cm, p, nbytes, node in self.rg) for c, p in zip(cost, choices)]
        else:
            # A user input: each rank loads its own shard, so any even split is free.
            choices = placement_choices(shape, self.mesh, grid_weight=False)
            if node.name in self.hints.input_exact:
                choices = self._exact(node, f"input {node.name}", choices, self.hints.input_exact[node.name])
            mem = [0.0] * len(choices)
            cost = [0.0] * len(choices)
        self._open_group(it, choices, cost, mem, [0.0] * len(choices), step, own_mem)
        self.place[it] = choices
        grad = bytes_per_param(self.memory.layout, self.memory.fp32_grad_accum)[1]
        # a gradient that lands in a bucket the runtime kept from the last step adds nothing to
        # backward: the bucket is held from forward on (``forward_param_bytes``). Not a tied
        # parameter's: its readers' gradients are summed as ``.grad`` before its bucket's copy
        bucket = np.array([val.numel() * grad / w if self._bucketed(node, p) and node.name not in self._tied_names
                           else 0.0 for p, w in zip(choices, shards)]) if it.kind == "param" else 0.0
        if it.kind == "param" and node in self.rg and it in self.head_params:
            # the head's backward ran before the last layer's: its gradients are held, as placed
            self.groups[it.group].bwd_mem += np.array([val.numel() * grad / w for w in shards]) - bucket
            self.groups[it.group].head_mem -= bucket  # (the head's ops count them as they compute them)
        if it.kind == "param" and it in self._last_layer_params:
            self.groups[it.group].bwd_mem -= bucket  # (... and the last layer's ops)
        if it.kind == "param" and it in self._freed_by_head and kept is not None:
            # its whole copy kept for backward (ZeRO-2) served only the head, whose backward freed it
            self.groups[it.group].bwd_mem -= np.asarray(kept, dtype=float)
            self.groups[it.group].head_mem -= np.asarray(kept, dtype=float)

    def _bucketed(self, node, placement: tuple) -> bool:
        """Whether parameter ``node``'s gradient, stored at ``placement``, lies in a bucket the
        runtime keeps between steps (``MemoryModel.kept_buckets``): it is summed over ranks (its
        placement replicates it over an axis of more than one device, as ``step_scratch``
        reckons it: an upper bound where no reader splits its work there)."""
        return bool(self.memory.kept_buckets) and node in self.rg and any(
            t == REPLICATE and n > 1 for t, n in zip(placement, self.mesh))

    def _exact(self, node, what: str, choices: list, want) -> list:
        want = tuple(want)
        if want not in choices:
            raise HintUnsatisfiable(
                f"{what} (shape {tuple(node.meta['val'].shape)}) cannot be placed {'(' + ','.join(want) + ')'} "
                f"on mesh {self.mesh}: its placements here are {', '.join('(' + ','.join(c) + ')' for c in choices)}. "
                f"Fix: give a placement whose splits divide the shape on this mesh")
        return [want]

    def _shared_result(self, key, compute):
        """Items with one signature (and the same operand placement lists) get the same
        strategies and costs: compute once per mesh shape, share the objects."""
        got = self._shared.get(key)
        if got is None:
            got = self._shared[key] = compute()
        return got

    def _node_timer(self, it: Item, grads: list[bool]) -> NodeTimer:
        """The timer of ``it``'s node, one per signature on this cost model (``CostModel.memo``):
        every problem a search builds on one mesh shape times its nodes alike."""
        key = ("node_timer", it.signature, tuple(grads))
        timer = self.cm.memo.get(key)
        if timer is None:
            timer = self.cm.memo[key] = NodeTimer(it.node, self.cm, grads)
        return timer

    def _decision(self, it: Item):
        node = it.node

        def compute():
            strategies, fb = enumerate_strategies(node, self.mesh, self.hints.temporal, self._enum_cache)
            grads = [o in self.rg for o in tensor_operands(node)]
            timer = self._node_timer(it, grads)
            place = self._shared_result(("place", id(strategies)), lambda: [s.out for s in strategies])
            return (strategies, fb, [timer(s) for s in strategies],
                    transient_bytes(node, strategies, self.mesh, self.memory), place, timer,
                    stash_bytes(node, strategies, self.mesh, any(grads)))

        strategies, fb, cost, tr, place, timer, stash = self._shared_result(("decision", it.signature), compute)
        if fb:
            self.fallback[str(node.target)] += 1
        kept = self._hinted(node, strategies)
        if kept is not strategies:  # a hint narrowed this node: its own lists
            keep = set(kept)
            idx = [i for i, s in enumerate(strategies) if s in keep]
            strategies, cost, tr, stash = kept, [cost[i] for i in idx], [tr[i] for i in idx], [stash[i] for i in idx]
            place = [s.out for s in strategies]
        if it in self.facts.head and any(grads := [o in self.rg for o in tensor_operands(node)]):
            # a head op's backward runs while all forward saved is alive: its gradients are a
            # working set of that moment, as the loss's copies are (the larger of the two)
            back = self._shared_result(("head-grads", id(strategies), it.signature),
                                       lambda: [max(g, r) for g, r in zip(grad_bytes(node, strategies, self.mesh, grads),
                                                                          ring_backward_bytes(node, strategies, self.mesh))])
            tr = [max(a, b) for a, b in zip(tr, back)]
        replayed = self.recompute and it in self.facts.layer_items
        mem = stash  # (the op's own saved blocks: forward memory)
        if replayed:  # its forward runs again in backward; what it keeps lives only during its layer's
            fwd = self._shared_result(("replay", it.signature, id(strategies)), lambda: [timer.forward(s) for s in strategies])
            mem = [0.0] * len(stash)
            if self.selective and it in self.facts.saved_uses:  # ... unless selective recomputation
                fwd, mem = self._shared_result(("selective", it.signature, id(strategies)),  # keeps its output
                                               lambda: self._selective_kept(node, strategies, fwd))
            cost = [c + f for c, f in zip(cost, fwd)]
        self._open_group(it, strategies, cost, mem, tr)
        self.place[it] = place
        self.timers[it.group] = timer
        tails = self._shared_result(("tails", it.signature, id(strategies)),
                                    lambda: [timer.meeting_tail(s) for s in strategies])
        if any(t is not None for t in tails):
            self.meets[it] = tails
        if it in self.facts.head:
            self.groups[it.group].head_mem += self._weight_grad_bytes(it, strategies)
        if it in self.facts.last_layer:
            self.groups[it.group].bwd_mem += self._weight_grad_bytes(it, strategies)
            # (a P(2^k x 2^k) op's backward holds its ring's blocks: costs.ring_backward_bytes)
            needs = any(o in self.rg for o in tensor_operands(node))
            back = ring_backward_bytes(node, strategies, self.mesh) if needs else [0.0] * len(tr)
            self.groups[it.group].bwd_transient = [max(a, b) for a, b in zip(tr, back)]
            if replayed:
                self.groups[it.group].bwd_mem += np.asarray(stash, dtype=float)

    def _selective_kept(self, node, strategies, fwd) -> tuple[list[float], list[float]]:
        """Per strategy, (replayed forward seconds, bytes kept from forward to backward) of an
        op inside a layer, whose output backward keeps anyway (``GraphFacts.saved_uses``),
        under selective recomputation: a strategy that runs it as a plain matmul or fused
        attention (``kept_when_selective``) keeps its local output (the checkpoint's cache,
        the bytes a plan without recomputation keeps of it) and is not replayed; any other is
        replayed and keeps nothing. (A matmul whose output no op saves, such as a row-parallel
        linear's partial sum, is replayed: caching it would keep more than no recomputation.)"""
        val = node.meta["val"]
        nbytes = val.numel() * val.element_size()
        kept = [kept_when_selective(node, s.kind) for s in strategies]
        return ([0.0 if k else f for k, f in zip(kept, fwd)],
                [self.memory.saved_bytes(nbytes, shard_factor(s.out, self.mesh)) if k else 0.0
                 for k, s in zip(kept, strategies)])

    def _selective_names(self, choice: list[int]) -> list[str]:
        """The nodes whose outputs selective recomputation keeps under ``choice`` (in graph
        order: ``passes.recompute`` keeps exactly these kernels' outputs)."""
        f = self.facts
        return [n.name for n, it in f.node_item.items()
                if it.kind == "decision" and it in f.layer_items and it in f.saved_uses
                and kept_when_selective(n, self.groups[it.group].strategies[choice[it.group]].kind)]

    def _weight_grad_bytes(self, it: Item, strategies) -> np.ndarray:
        """Per strategy, the gradients of the parameters the op reads, as its backward
        computes them: at the placement it reads each one in (the memory model's backward
        phase, for the last layer's ops)."""
        ops = tensor_operands(it.node)
        idx = tuple(i for i, o in enumerate(it.operands) if o is not None and o.kind == "param" and ops[i] in self.rg)
        if not idx:
            return np.zeros(len(strategies))
        sizes = [ops[i].meta["val"].numel() * ops[i].meta["val"].element_size() for i in idx]
        return self._shared_result(("wgrad", id(strategies), idx, tuple(sizes)), lambda: np.array(
            [sum(nb / shard_factor(s.ins[i], self.mesh) for i, nb in zip(idx, sizes)) for s in strategies]))

    def _derived(self, it: Item):
        """A node whose live (non-constant) operands all come from one group — elementwise
        ops with constants, reductions, and ops joining values of one group (RMSNorm's
        x * rsqrt(mean(x^2)), RoPE's halves): its strategy follows from that group's
        choice (``strategies.derive``); where no strategy keeps the operands where they
        are, they are gathered to Replicate first. A modelling restriction, like
        followers: such a node never reshards on its own to please its consumers."""
        node, live = it.node, it.live
        sources = [self.place[it.operands[i]] for i in live]

        def compute():
            ops = tensor_operands(node)
            timer = self._node_timer(it, [o in self.rg for o in ops])
            rep_p = tuple(REPLICATE for _ in self.mesh)
            strategies, extra, replay = [], [], []
            # the answer for a key depends on the node's signature alone: items of one
            # signature (RMSNorm's ops before attention and before the MLP) share it
            cache = self._by_key.setdefault(("derived", it.signature, live), {})
            for key in zip(*sources):  # the live operands' placements under each group choice
                if key not in cache:
                    s = derive(node, dict(zip(live, key)), self.mesh, self._derive_cache)
                    cost = 0.0
                    if s is None:
                        for i, p in zip(live, key):
                            v = ops[i].meta["val"]
                            cost += reshard_cost(self.cm, p, rep_p, v.numel() * v.element_size(),
                                                 (False,) * len(self.mesh), ops[i] in self.rg)
                        s = Strategy(out=rep_p, ins=tuple(rep_p for _ in ops))
                    cache[key] = (s, cost + timer(s), timer.forward(s))
                s, cost, fwd = cache[key]
                strategies.append(s)
                extra.append(cost)
                replay.append(fwd)
            return [s.out for s in strategies], strategies, np.array(extra), np.array(replay)

        key = ("derived", it.signature, live, tuple(id(p) for p in sources))
        self.place[it], self.derived[it], extra, replay = self._shared_result(key, compute)
        self._add_extra(it, extra + replay if self.recompute and it in self.facts.layer_items else extra)

    def _follower(self, it: Item):
        node = it.node
        source = self.place[it.operands[0]]

        def compute():
            val, sval = node.meta["val"], it.operands[0].node.meta["val"]
            rg = node in self.rg
            dt = dtype_name(val.dtype)
            view = is_view_like(node)
            rule = follow_rule(node)
            # many group choices share an output placement, many items a signature: one answer each
            by_input = self._by_key.setdefault(("follower", it.signature), {})
            for p in source:
                if p in by_input:
                    continue
                q, via, cost, fwd = rule(p, self.mesh), p, 0.0, 0.0
                if q is None:  # cannot keep the layout through this op: reshard its input first
                    via, cost = self._nearest_followable(p, rule, sval, rg)
                    q = rule(via, self.mesh)
                if not view:
                    split = shard_factor(q, self.mesh)
                    moved = (node.meta["bytes_read"] + node.meta["bytes_written"]) / split
                    # (its output, and in backward its input's gradient, of the output's local size
                    # (an elementwise op), each a new tensor: ``CostModel.fresh``)
                    made = self.cm.fresh(val.numel() * val.element_size() / split)
                    op = slowdown_key(node)  # (gelu's tanh approximation: its own slowdown)
                    cost += self.cm.compute(node.meta["flops"] / split, moved * (3 if rg else 1), dt,
                                            op) + made * (2 if rg else 1)
                    fwd = self.cm.compute(node.meta["flops"] / split, moved, dt, op) + made
                by_input[p] = (q, cost, via, fwd)
            return ([by_input[p][0] for p in source], np.array([by_input[p][1] for p in source]),
                    [by_input[p][2] for p in source], np.array([by_input[p][3] for p in source]))

        self.place[it], extra, self.follow_via[it], replay = self._shared_result(
            ("follower", it.signature, id(source)), compute)
        # (replayed under recompute: its forward compute; a reshard of its input, a named
        # simplification, is not charged again)
        self._add_extra(it, extra + replay if self.recompute and it in self.facts.layer_items else extra)

    def _nearest_followable(self, p: tuple, rule, val, rg: bool) -> tuple[tuple, float]:
        """(input placement, seconds to reach it from ``p``) for a follower that cannot keep
        ``p``: on each axis whose split it cannot keep, Replicate or a split of another dim
        (a view merging a batch dim with a split sequence dim keeps a batch split), whichever
        placement it can keep is cheapest to reach (Replicate on a tie: every consumer
        can slice it for free)."""
        nd = len(self.mesh)
        rep = (REPLICATE,) * nd
        culprits = [a for a in range(nd) if p[a][0] in "SBXW" and self.mesh[a] > 1 and
                    rule(tuple(t if b == a else REPLICATE for b, t in enumerate(p)), self.mesh) is None]
        if not culprits:
            culprits = [a for a in range(nd) if p[a] != REPLICATE]
        options = [REPLICATE] + [shard(d) for d in range(val.dim())]
        nbytes = val.numel() * val.element_size()
        best, best_cost = rep, reshard_cost(self.cm, p, rep, nbytes, (False,) * nd, rg)
        for picks in itertools.product(options, repeat=len(culprits)):
            cand = list(p)
            for a, t in zip(culprits, picks):
                cand[a] = t
            cand = tuple(cand)
            if cand in (rep, p) or not fits(tuple(val.shape), cand, self.mesh) or rule(cand, self.mesh) is None:
                continue
            c = reshard_cost(self.cm, p, cand, nbytes, (False,) * nd, rg)
            if c < best_cost:
                best, best_cost = cand, c
        return best, best_cost

    def _add_extra(self, it: Item, extra: np.ndarray):
        self.extra[it] = extra
        self.groups[it.group].cost += extra * it.count

    # ---------------------------------------------------------------- edges
    def _solver_edges(self) -> list[Edge]:
        """Resharding costs on the tensor inputs of decision nodes.

        The cost of an edge is a sum over mesh axes of a term that depends on the
        producer's whole placement (it sets the bytes) and on the consumer's token
        and split flag on that axis only. So each input edge becomes one solver
        edge per mesh axis, with consumer classes per axis: the class pairs grow
        with the sum, not the product, of the per-axis options. Tables of tied
        copies add up (in ns)."""
        merged: dict[tuple, dict] = {}
        for (src, dst, i), count in self.facts.edge_uses.items():
            for ucls, vcls, table in self._edges_of(src, dst, i):
                acc = merged.setdefault((src.group, dst.group, ucls, vcls), {})
                for k, c in table.items():
                    acc[k] = acc.get(k, 0.0) + c * count
        return [Edge(u, v, ucls, vcls, {k: int(round(c * NS)) for k, c in t.items() if c})
                for (u, v, ucls, vcls), t in merged.items()]

    def _gathered_copy_edges(self, readers: set, copy_bytes) -> list[tuple[Item, Edge]]:
        """Per parameter, op of ``readers`` reading it whole (R or P) on a mesh axis it is
        stored split on and not kept gathered over (ZeRO-3), and that axis: an edge holding
        ``copy_bytes(b)``, ``b`` the bytes of its copy gathered over the axis (split as stored
        on the others); with the parameter's Item. Parameters read through a shared read
        are not charged (none are: parameters keep their edges, ``analysis._share_reads``)."""
        out = []
        for src, dst, i in self.facts.edge_uses:
            if src.kind != "param" or dst not in readers or src.node not in self.rg:
                continue
            val = src.node.meta["val"]
            nbytes = val.numel() * val.element_size()
            place, strategies = self.place[src], self.groups[dst.group].strategies
            producer = self._shared_result(("ucls", id(place)), lambda: self._producer_classes(place))
            consumer = self._shared_result(("vcls", id(strategies), i), lambda: self._consumer_classes(strategies, i))
            for a, n in enumerate(self.mesh):
                if n == 1 or a in self.hints.keep_gathered:
                    continue
                (ucls, ukeys), (vcls, vkeys) = producer[a], consumer[a]
                table = {(pc, qc): int(round(copy_bytes(nbytes / sf)))
                         for pc, (tok, sf) in enumerate(ukeys) if tok[0] not in "RP"
                         for qc, (q, _) in enumerate(vkeys) if q[0] in "RP"}
                if table:  # (classes alike in every entry merged: a few pairs, not placements squared)
                    rmap, cmap, table = _merge_classes(len(ukeys), len(vkeys), table)
                    out.append((src, Edge(src.group, dst.group, tuple([rmap[c] for c in ucls]),
                                          tuple([cmap[c] for c in vcls]), table)))
        return out

    def _regather_edges(self) -> list[Edge]:
        """The backward phase's memory edges (``Problem.mem_edges``): a parameter an op of the
        last layer reads whole on a mesh axis it is stored split on (ZeRO-3) is gathered
        again for that op's backward; on each such axis the edge holds
        ``MemoryModel.regathered_bytes`` of its copy gathered over the axis. One layer's
        worth, whatever the tied count."""
        staging = self.cm.cluster.gather_staging
        return [e for _, e in self._gathered_copy_edges(
            self.facts.last_layer, lambda b: self.memory.regathered_bytes(b, staging))]

    def _kept_head_edges(self) -> tuple[list[Edge], list[Edge]]:
        """The head's ZeRO-3 parameters, kept whole from forward for their backward
        (``passes.prefetch_params`` waits the head's gathers with ``keep``; FSDP2 keeps its
        root module's alike): per (parameter, head op reading it whole on a mesh axis it is
        stored split on), its copy gathered over that axis. Returns (held from the end of
        forward on: ``saved_edges``; the same negated, for the phases after the head's
        backward freed it: ``head_edges`` and ``mem_edges``; none for a parameter an op
        outside the head also keeps)."""
        held, freed = [], []
        for src, e in self._gathered_copy_edges(self.facts.head, lambda b: b):
            held.append(e)
            if src in self._freed_by_head:
                freed.append(Edge(e.u, e.v, e.ucls, e.vcls, {k: -b for k, b in e.table.items()}))
        return held, freed

    def _saved_read_edges(self) -> tuple[list[Edge], list[Edge]]:
        """A saved tensor its saver reads through a reshard is kept as the saver read it:
        the op saves the reshard's output (a linear under sequence-parallel TP keeps the
        all-gathered norm output, the whole sequence; the runtime bench's TP plan measured
        those copies, 4 MiB each where the producer's shard is 1 MiB, as the 15 MiB its
        modelled peak was short). ``_saved_memory`` charges the tensor at its producer's
        placement; per (tensor, saver reading it as an operand under a spatial strategy) an
        edge adds the difference to the bytes at the placement the saver reads it in (the
        reshard's output; the producer's copy, read by nothing else, is gone). A tensor
        several ops save shares the difference among them equally (per node: the Item's
        nodes in tied layers may have other savers): exact where they read it in one placement (``cleanup`` merges their reshards into one: q, k and v reading
        the gathered norm), an average where they do not (a named simplification). A
        P(2^k x 2^k) saver keeps its own blocks instead (``_saved_edges``). Returns (held
        from the end of forward: ``saved_edges``; for what only the head saves, the same
        negated for the phases after the head's backward freed it: ``head_edges`` and
        ``mem_edges``). Under recomputation the savers in the recomputed layers keep none
        (their replay reads it again); the head's and the other layers' keep theirs."""
        f = self.facts
        saved = f.kept_saved if self.recompute else f.saved_uses
        held, freed = [], []
        # (vectorised over (producer placement, read placement): at 32 devices a producer has
        # hundreds of placements, and this loop was most of a search's time)
        at = {}  # (tensor bytes, placement) -> the bytes a saved copy of it holds

        def kept(nbytes, placements):
            return np.array([at.setdefault((nbytes, q), self.memory.saved_bytes(nbytes, shard_factor(q, self.mesh)))
                             for q in placements], dtype=np.float64)

        for it, shares in f.savers.items():
            if not saved[it]:
                continue
            val = it.node.meta["val"]
            nbytes, place = val.numel() * val.element_size(), self.place[it]
            at_place, row_of = kept(nbytes, place), {p: n for n, p in enumerate(place)}
            done = done_head = 0.0  # shares charged so far: each edge rounds the running sum (no
            for (saver, i), (share, head_share) in shares.items():  # byte lost to thirds)
                if saver.kind != "decision" or saver.group == it.group or (self.recompute and saver in f.layer_items):
                    continue
                before, before_head = done, done_head
                done, done_head = done + share, done_head + head_share
                strategies = self.groups[saver.group].strategies
                reads = sorted({s.ins[i] for s in strategies if s.kind != "p2x2"})
                none = len(reads)  # the column of the strategies that keep blocks of their own
                d = kept(nbytes, reads)[None, :] - at_place[:, None]
                table = np.zeros((len(place), none + 1), dtype=np.int64)
                table[:, :none] = np.round(done * d) - np.round(before * d)
                for qc, q in enumerate(reads):  # read as produced: no reshard, no copy
                    if q in row_of:
                        table[row_of[q], qc] = 0
                if not table.any():
                    continue
                head_table = np.zeros_like(table)
                head_table[:, :none] = np.where(table[:, :none] != 0, np.round(before_head * d) - np.round(done_head * d), 0)
                qidx = {q: n for n, q in enumerate(reads)}
                rows, cols, table = _merge_dense(table)
                vcls = tuple(cols[none if s.kind == "p2x2" else qidx[s.ins[i]]] for s in strategies)
                held.append(Edge(it.group, saver.group, tuple(rows), vcls, table))
                if head_table.any():
                    rows, cols, head_table = _merge_dense(head_table)
                    vcls = tuple(cols[none if s.kind == "p2x2" else qidx[s.ins[i]]] for s in strategies)
                    freed.append(Edge(it.group, saver.group, tuple(rows), vcls, head_table))
        return held, freed

    def _saved_edges(self) -> list[Edge]:
        """Memory edges of the tensors forward saves (``Problem.saved_edges``): a tensor kept
        for backward only because one op saves it, and that op under a P(2^k x 2^k) strategy
        keeps the blocks its ring received instead (``stpc::primepar_linear``'s stashes,
        ``costs.stash_bytes``; the fidelity bench's p2x2 plan measured its norms' and GELU's
        outputs not kept), is not held: its bytes at its producer's placement, taken off
        where its saver takes such a strategy. A tensor several ops save, such as the norm
        before q, k and v, is not held where all of them take one (:meth:`_shared_saved_edges`;
        without recomputation). Not for what only the head saves (its phases free it anyway).
        Under recomputation, the entry edges of the recomputed layers' checkpoints
        (``_kept_entry_edges``), and these only for a saver in a layer that is not recomputed
        (``Hints.recompute_layers``)."""
        f = self.facts
        out = self._kept_entry_edges() if self.recompute else []
        saved = f.kept_saved if self.recompute else f.saved_uses
        for it, (saver, i) in f.sole_saver.items():
            if not saved[it] or f.head_saved[it] or saver.kind != "decision" or saver.group == it.group:
                continue
            if self.recompute and (saver in f.layer_items or layer_of(saver.node) is None):
                continue
            strategies = self.groups[saver.group].strategies
            keeps_blocks = tuple(int(s.kind == "p2x2") for s in strategies)
            if not any(keeps_blocks):
                continue
            val = it.node.meta["val"]
            nbytes = val.numel() * val.element_size()
            place = self.place[it]
            count = f.sole_saved[(it, saver, i)] if self.recompute else saved[it]
            table = {(pc, 1): -int(round(count * self.memory.saved_bytes(nbytes, shard_factor(p, self.mesh))))
                     for pc, p in enumerate(place)}
            out.append(Edge(it.group, saver.group, tuple(range(len(place))), keeps_blocks, table))
        return out + ([] if self.recompute else self._shared_saved_edges())

    def _shared_saved_edges(self) -> list[Edge]:
        """The saved-tensor memory edges of a tensor that n >= 2 ops (of different groups, every
        one reading it as an operand) save, and that none holds where all of them take a
        P(2^k x 2^k) strategy (each keeps its own blocks; the fidelity bench's p2x2 plan held
        none of its q/k/v norms' outputs, 32 MiB its model had charged). Held is B (1 - x_1 ...
        x_n), x_i = 1 where saver i keeps blocks and B the tensor's bytes at its producer's
        placement: a product of n choices, which pairwise edges cannot say exactly. They say
        B (1 - x_1) + B_max x_1 sum_{i >= 2} (1 - x_i): exact where the first saver keeps no
        blocks and where all of them do, more than B where the first one does and another does
        not (memory charged, never missed; B_max the largest B over the producer's placements)."""
        f = self.facts
        out = []
        for it in f.savers:
            joint = self.joint_keeps(it)
            if joint is None:
                continue
            savers, keeps = joint
            count = f.saved_uses[it]
            held = [int(round(count * b)) for b in self._saved_by_place(it)]
            first = savers[0]
            out.append(Edge(it.group, first.group, tuple(range(len(held))), keeps[0],
                            {(pc, 1): -b for pc, b in enumerate(held)}))
            for saver, k in zip(savers[1:], keeps[1:]):
                out.append(Edge(first.group, saver.group, keeps[0], k, {(1, 0): max(held)}))
        return out

    def _saved_by_place(self, it) -> list[float]:
        """The bytes per device ``it`` takes saved for backward at each of its placements."""
        val = it.node.meta["val"]
        nbytes = val.numel() * val.element_size()
        return [self.memory.saved_bytes(nbytes, shard_factor(p, self.mesh)) for p in self.place[it]]

    def joint_keeps(self, it) -> tuple[list, list[tuple[int, ...]]] | None:
        """The savers of ``it`` that :meth:`_shared_saved_edges` relieves together
        (``GraphFacts.joint_savers``) and, per saver, which of its group's strategies keep
        their own blocks (1: P(2^k x 2^k)); None where they are not joint savers or one of them
        has no such strategy (then the tensor stays charged whole)."""
        savers = self.facts.joint_savers(it)
        if savers is None:
            return None  # (a saver reading it not as an operand, two in one group, or copies of
            # it in tied layers saved by different ops)
        keeps = [tuple(int(s.kind == "p2x2") for s in self.groups[saver.group].strategies) for saver in savers]
        return (savers, keeps) if all(any(k) for k in keeps) else None

    def jointly_saved_bytes(self, kinds: dict[str, str]) -> dict[str, int]:
        """What the model holds (per device) of each tensor several ops save jointly
        (:meth:`joint_keeps`) whose first saver keeps its own blocks, under a plan whose ops
        take the families ``kinds`` (node name -> strategy kind): B_max x the savers after the
        first that keep none (:meth:`_shared_saved_edges`' charge, B_max the largest B over
        the producer's placements). A tensor not named here is held at its producer's
        placement. Kept in ``plan.stats["jointly_saved_bytes"]``, so a plan read from disk,
        which keeps no strategies, draws it as it was planned (``viz.memory_timeline``)."""
        out = {}
        for it in self.facts.savers:
            joint = self.joint_keeps(it)
            if joint is None or kinds.get(joint[0][0].node.name) != "p2x2":
                continue
            most = max(self._saved_by_place(it))
            out[it.node.name] = int(round(most * sum(kinds.get(s.node.name) != "p2x2" for s in joint[0][1:])))
        return out

    def _kept_entry_edges(self) -> list[Edge]:
        """Under full recomputation, the memory edges of what a layer's checkpoint keeps beyond
        the tensor entering it (``GraphFacts.kept_saved`` counts that one, at its producer's
        placement): the layer's first op reading it in another placement reads it through a
        reshard the passes put just before that op, between the spans, outside both
        (``passes.recompute``; a reshard into a later op of the layer sits inside the span and
        is replayed), so the span keeps that copy too (the fidelity bench's recompute plan
        under TP: each layer's span reads the partial residual and its all-reduced copy, 8 MiB
        each per layer). Held like a saved tensor from the end of forward through backward:
        ``Problem.saved_edges``. An entering tensor that no op of the layer reads as produced
        stays charged: an upper bound."""
        out = []
        for (src, dst, i), count in self.facts.entry_edges.items():
            if dst.kind != "decision" or src.group == dst.group:
                continue
            place, strategies = self.place[src], self.groups[dst.group].strategies
            val = src.node.meta["val"]
            nbytes = val.numel() * val.element_size()
            reads = sorted({s.ins[i] for s in strategies})
            table = {(pc, qc): int(round(count * self.memory.saved_bytes(nbytes, shard_factor(q, self.mesh))))
                     for pc, p in enumerate(place) for qc, q in enumerate(reads) if p != q}
            if any(table.values()):
                qidx = {q: n for n, q in enumerate(reads)}
                rmap, cmap, table = _merge_classes(len(place), len(reads), table)
                out.append(Edge(src.group, dst.group, tuple(rmap),
                                tuple(cmap[qidx[s.ins[i]]] for s in strategies), table))
        return out

    def _transient_edges(self) -> list[Edge]:
        """The end of forward's working-set edges (``Problem.transient_edges``): an op of
        ``costs.RESHARD_COPIES`` (the loss) holds that many more copies of its first operand,
        at the placement it reads it in, where that operand reaches it through a reshard to a
        split layout: its producer holds another placement than the op reads, or a view
        between them cannot keep its input's layout and reshards it (``follow_via``; views
        join their producer's group, so either is a function of the pair of choices). Not
        where every axis that changes is gathered to Replicate or turns one plain split into
        another (``_dual_holds_no_copy``: the dual slices the gradient where it is, or the
        runtime frees the all-to-all's send buffer once exchanged), nor for a ``derived`` op
        between them gathering to Replicate. (Measured, 4 gloo ranks, llama-tiny under
        Megatron on 2 x 2: the logits split on the vocabulary over TP, gathered over TP into
        the loss; the step's peak, in the loss's backward, held two logits copies above the
        end of forward, the loss's own, none for the gather.)"""
        out = []
        for it in self.facts.items:
            copies = RESHARD_COPIES.get(it.node.target, 0) if it.kind == "decision" else 0
            src = it.operands[0] if copies and it.operands else None
            if src is None or src.group == it.group:
                continue
            place, strategies = self.place[src], self.groups[it.group].strategies
            via = [False] * len(place)  # a view on the way resharded its input, per producer choice
            link = src
            while link.kind == "follower" and link.operands and link.operands[0] is not None:
                before = self.place[link.operands[0]]
                via = [v or (a != b and _split(a)) for v, a, b in zip(via, self.follow_via[link], before)]
                link = link.operands[0]
            val = src.node.meta["val"]  # (the operand as the op reads it: a view's output, if one)
            nbytes = val.numel() * val.element_size()
            pkeys, reads = sorted(set(zip(place, via))), sorted({s.ins[0] for s in strategies})
            table = {(pc, qc): int(round(copies * nbytes / shard_factor(q, self.mesh)))
                     for pc, (p, moved) in enumerate(pkeys) for qc, q in enumerate(reads)
                     if moved or (p != q and _split(q) and not _dual_holds_no_copy(p, q))}
            if any(table.values()):
                pidx, qidx = {k: n for n, k in enumerate(pkeys)}, {q: n for n, q in enumerate(reads)}
                # (producers alike towards every read merged: a few class pairs, which keeps the
                # least-memory solve as quick as without the edge)
                rmap, cmap, table = _merge_classes(len(pkeys), len(reads), table)
                out.append(Edge(src.group, it.group, tuple(rmap[pidx[k]] for k in zip(place, via)),
                                tuple(cmap[qidx[s.ins[0]]] for s in strategies), table))
        return out

    def _head_reduction_edges(self) -> list[Edge]:
        """The head phase's memory edges (``Problem.head_edges``): per parameter a head op
        reads and that needs a gradient, the buffers its gradient's reduction holds while in
        flight (``costs.grad_reduction_bytes``), by the pair of its stored placement and the
        placement (and work split) its reader reads it in."""
        staging = self.cm.cluster.gather_staging
        out = []
        for src, dst, i in self.facts.edge_uses:
            if (src.kind != "param" or dst.kind != "decision" or dst not in self.facts.head
                    or src.node not in self.rg):
                continue  # (a derived head op, planned through its operand's group: not charged)
            val = src.node.meta["val"]
            nbytes = val.numel() * val.element_size()
            stored, strategies = self.place[src], self.groups[dst.group].strategies
            reads = sorted({(s.ins[i], s.split_axes()) for s in strategies})
            rcls = {r: k for k, r in enumerate(reads)}
            table = {(pc, qc): int(round(grad_reduction_bytes(p, q, sp, nbytes, self.mesh, staging)))
                     for pc, p in enumerate(stored) for qc, (q, sp) in enumerate(reads)}
            if any(table.values()):
                out.append(Edge(src.group, dst.group, tuple(range(len(stored))),
                                tuple(rcls[(s.ins[i], s.split_axes())] for s in strategies), table))
        return out

    def _edges_of(self, src: Item, dst: Item, i: int):
        key = (src, dst, i)
        got = self._edge_cache.get(key)
        if got is None:
            got = self._edge_cache[key] = self._operand_edges(src, dst, i)
        return got

    def _shares(self) -> list[Share]:
        """One ``Share`` per shared read: per axis, the reshard from each producer class to
        each key's class there (its token and work split), as an edge costs it; summed
        over the axes, paid once per distinct key (times the tied copies)."""
        out, self._share_costs = [], []
        for sr in self.facts.shared:
            place = self.place[sr.src]
            val = sr.src.node.meta["val"]
            nbytes, rg = val.numel() * val.element_size(), sr.src.node in self.rg
            index: dict = {}
            keys = []
            for dst, i in sr.uses:
                strategies = self.groups[dst.group].strategies
                keys.append(np.array([index.setdefault((s.ins[i], s.split_axes()), len(index)) for s in strategies]))
            key_list = list(index)
            tails = self.meets.get(sr.src)
            producer = self._producer_axis_classes(place, tails)
            replayed = self.recompute and any((sr.src, d, i) in self.facts.replayed_edges for d, i in sr.uses)
            axes, seconds = [], np.zeros((len(place), len(key_list)))
            for a in range(len(self.mesh)):
                ucls, ukeys = producer[a]
                kcls, kkeys = _classes([(ins[a], split[a]) for ins, split in key_list])
                sig = self.cm.axis_signature(a)
                table = np.zeros((len(ukeys), len(kkeys)))
                for pc, ukey in enumerate(ukeys):
                    (tok, sf), since = ukey if tails is not None else (ukey, None)
                    for qc, (q, split) in enumerate(kkeys):
                        k = (sig, tok, q, nbytes / sf, split, rg, replayed, since)
                        c = self._reshard.get(k)
                        if c is None:
                            c = self._reshard[k] = axis_reshard(self.cm, a, tok, q, nbytes / sf, split, rg, replayed,
                                                                since)
                        table[pc, qc] = c
                if not table.any():
                    continue
                uc, kc = np.asarray(ucls), np.asarray(kcls)
                axes.append((uc, kc, np.rint(table * (sr.count * NS)).astype(np.int64)))
                seconds += table[np.ix_(uc, kc)]
            dense = sum((t[np.ix_(uc, kc)] for uc, kc, t in axes), np.zeros(seconds.shape, dtype=np.int64))
            rows, row_of = np.unique(dense, axis=0, return_inverse=True)
            out.append(Share(sr.src.group, tuple(d.group for d, _ in sr.uses), row_of.reshape(-1), tuple(keys),
                             rows, axes))
            self._share_costs.append((seconds, keys))
        return out

    def _operand_edges(self, src: Item, dst: Item, i: int):
        # (Combining the per-axis edges into one transport edge was measured: its tighter
        # LP did not pay for its extra variables on any zoo model.)
        place, strategies = self.place[src], self.groups[dst.group].strategies
        val = src.node.meta["val"]
        nbytes, rg = val.numel() * val.element_size(), src.node in self.rg
        if self.facts.group_items[src.group].kind == "param":
            win = self._windows(dst, i)
            layer = self._layer_bytes.get(src.node, 0.0)
            inline = self.recompute and dst in self.facts.layer_items
            kept = dst in self.facts.head  # (the head's gathers are kept for backward: not made again)
            # a gather is made again in backward only for an op that reads the weight there
            # (``passes.prefetch_params``' groups, through ``RegatherSaved``: an embedding keeps
            # its indices, not its table); one several readers share, if any of them outside the
            # head does (a gather the head reads is kept from forward)
            saves = (self._saves(dst.node, i),) * 2
            roles = None
            if (reader := self._reader_of.get((src, dst, i))) is not None and src.group in self._sum_modes:
                modes = self._sum_modes[src.group]
                roles = (tuple(tuple(grad_sum.role(m[a], reader) for m in modes) for a in range(len(self.mesh))),
                         self._readers[src.group].pen_bytes)
                saves = (saves[0], self._readers[src.group].saved)
            key = ("param-edge", id(place), nbytes, layer, rg, id(strategies), i, id(win), inline, kept, roles, saves)
            return self._shared_result(key, lambda: self._param_edge(place, nbytes, layer, rg, strategies, i, win,
                                                                     inline, kept, roles, saves))
        replayed = self.recompute and (src, dst, i) in self.facts.replayed_edges
        tails = self.meets.get(src)
        key = ("edges", id(place), nbytes, rg, id(strategies), i, replayed, id(tails))
        return self._shared_result(key, lambda: [
            e for e in (self._axis_edge(place, nbytes, rg, strategies, i, a, replayed, tails)
                        for a in range(len(self.mesh)))
            if e[2]])

    def _windows(self, dst: Item, i: int) -> list[tuple[float, float]]:
        """Per choice of consumer ``dst``: the (forward, backward) compute that operand i's
        synchronisation may hide behind (``NodeTimer.windows``). The consumer's parameters
        share it by size (a weight and its bias), and the mesh axes (of more than one
        device) share it equally: the exposed time of a sum of collectives is not a sum
        over axes, and equal parts never under-charge it (the exposed time is convex in
        the collective's time and 0 at 0); one axis carrying all the traffic on a
        multi-axis mesh is over-charged."""
        ops = tensor_operands(dst.node)
        sizes = [o.meta["val"].numel() if it is not None and self.facts.group_items[it.group].kind == "param"
                 else 0 for o, it in zip(ops, dst.operands)]
        scale = sizes[i] / sum(sizes) / max(1, sum(n > 1 for n in self.mesh))
        strategies, timer = self.groups[dst.group].strategies, self.timers[dst.group]
        return self._shared_result(("windows", id(strategies), id(timer), scale), lambda: [
            (f * scale, b * scale) for f, b in map(timer.windows, strategies)])

    def _param_edge(self, place, nbytes, layer, rg, strategies, i, win, inline=False, kept=False, roles=None,
                    saves=(True, True)):
        """Per-axis edges from a parameter to its consumer: on each axis the reshard's forward
        and backward parts, each overlapped with the consumer's compute of that phase
        (``CostModel.overlapped``, windows from :meth:`_windows`). Its collectives ride in
        the runtime's coalesced messages: a data-parallel gradient in a bucket of
        ``MemoryModel.grad_bucket_bytes`` (without buckets, its own all-reduce, waited where
        it is made: not overlapped), a ZeRO gather and reduce-scatter in its layer's one collective
        (``layer``: the layer's parameter bytes, split on the other axes as this one is).
        ``inline``: the consumer sits in a recomputed layer (``passes.recompute``), whose
        ZeRO gathers stay the parameter's own, waited where they stand and replayed in
        backward (the regather): charged whole, as an activation's reshard is. ``kept``: the
        consumer is in the head, whose gathers are kept for backward (no regather).
        ``roles``: for a parameter several ops read, (per axis, this reader's ``grad_sum``
        role under each parameter choice's mode; the most bytes one of its reads moves whole,
        which sizes the penalty); None: charged as it stands. ``saves``: (whether the consumer
        reads the weight in backward, whether any of the parameter's readers does): a ZeRO-3
        gather is made again only then, the former for its own gather, the latter for one the
        readers share, which the earliest of them pays (``grad_sum``)."""
        edges = []
        for a in range(len(self.mesh)):
            ucls, ukeys = self._shared_result(("ucls", id(place)), lambda: self._producer_classes(place))[a]
            if roles is None:
                ukeys = [(k, grad_sum.AS_IS) for k in ukeys]
            else:  # (producer classes that differ in this reader's role only cost apart)
                ucls, ukeys = _classes([(ukeys[c], r) for c, r in zip(ucls, roles[0][a])])
            vcls, vkeys = self._shared_result(("vcls-win", id(strategies), i, id(win)), lambda: (
                self._consumer_window_classes(strategies, i, win)))[a]
            sig = self.cm.axis_signature(a)
            regather = a not in self.hints.keep_gathered and not kept
            pen_bytes = None if roles is None else roles[1]
            # (the memo is the cost model's, shared by builders of other memory models: whether the
            # buckets are kept changes the gradient's copy)
            key = ("param", sig, tuple(ukeys), tuple(vkeys), nbytes, layer, rg, inline, regather, pen_bytes, saves,
                   bool(self.memory.kept_buckets), self.bucket_bytes)
            merged = self._axis_tables.get(key)
            if merged is None:
                need, col = _classes([(q, split) for q, split, _ in vkeys])  # the reshards, without windows
                phases = np.zeros((2, len(ukeys), len(col)))
                copies = np.zeros((len(ukeys), len(col)))  # (on the rank's own thread: not overlapped)
                sums = np.zeros((len(ukeys), len(col)))  # (gradient sums waited where backward makes them)
                for pc, ((tok, sf), r) in enumerate(ukeys):
                    again = regather and saves[r == grad_sum.EARLIEST]
                    for qc, (q, split) in enumerate(col):
                        gathered = inline and tok[0] not in "RP" and q[0] in "RP"
                        k = (sig, tok, q, nbytes / sf, layer / sf, split, rg, again, gathered,
                             bool(self.memory.kept_buckets), self.bucket_bytes)
                        c = self._reshard_phases.get(k)
                        if c is None:
                            copy = sum(param_copy_phases(self.cm, a, tok, q, nbytes / sf, split, rg, regather=True
                                                         if gathered else again,
                                                         kept_bucket=bool(self.memory.kept_buckets)))
                            # split again on the axis (a replicated weight's slice, whose gradient is
                            # gathered back; a split weight re-cut): a redistribution waited where it
                            # stands, forward and backward (``runtime.shard_slice``, ``redistribute``),
                            # not a gather or a gradient sum the runtime overlaps
                            waited = q[0] not in "RP" and q != tok
                            if tok == q == REPLICATE and not self.bucket_bytes:
                                # a gradient summed without buckets: its own all-reduce, waited where
                                # backward makes it (blocking: below, with the compute since the last)
                                c = (0.0, 0.0), copy, axis_reshard_phases(self.cm, a, tok, q, nbytes / sf, split,
                                                                          rg)[1]
                            elif gathered or waited:  # (exposed: counted with the copies, not overlapped)
                                f, b = axis_reshard_phases(self.cm, a, tok, q, nbytes / sf, split, rg, regather=True,
                                                           messages=(self.bucket_bytes, 0.0))
                                c = ((0.0, 0.0), copy + self.cm.blocking(f) + self.cm.blocking(b, after_ring=q[0] in "XW"),
                                     0.0)
                            else:
                                c = (axis_reshard_phases(self.cm, a, tok, q, nbytes / sf, split, rg,
                                                         regather=again, messages=(self.bucket_bytes, layer / sf)),
                                     copy, 0.0)
                            self._reshard_phases[k] = c
                        phases[:, pc, qc], copies[pc, qc], sums[pc, qc] = c
                fwd, bwd = phases[:, :, list(need)]
                wins = np.array([w for _, _, w in vkeys]).reshape(-1, 2)
                cost = (self.cm.overlapped(fwd, wins[:, 0]) + self.cm.overlapped(bwd, wins[:, 1])
                        + copies[:, list(need)] + self._blocking_sums(sums[:, list(need)], wins[:, 1]))
                if pen_bytes is not None:
                    self._charge_sum_roles(cost, a, ukeys, vkeys, pen_bytes, rg)
                nz = np.nonzero(cost)
                table = dict(zip(zip(nz[0].tolist(), nz[1].tolist()), cost[nz].tolist()))
                merged = self._axis_tables[key] = _merge_classes(len(ukeys), len(vkeys), table)
            rmap, cmap, table = merged
            if table:
                edges.append((tuple([rmap[c] for c in ucls]), tuple([cmap[c] for c in vcls]), table))
        return edges

    def _blocking_sums(self, sums: np.ndarray, since: np.ndarray) -> np.ndarray:
        """Seconds of gradient sums waited where backward makes them (no buckets), producer
        rows by consumer columns: each a blocking collective (``CostModel.blocking``), the ranks'
        skew at it as the compute since they last met leaves it, by the square-root law:
        backward meets at every such sum, and between two of them runs one consumer's share of
        its backward (``since``, per column: the window its parameter's sum would have run beside)."""
        if not sums.any():
            return sums
        return np.vectorize(lambda s, w: self.cm.blocking(s, since_meeting_s=w))(sums, since[None, :])

    def _charge_sum_roles(self, cost: np.ndarray, a: int, ukeys, vkeys, pen_bytes: float, rg: bool) -> None:
        """Rows of a parameter edge's table on axis ``a`` (producer keys ``((token, split
        factor), role)``, consumer keys ``(token, split, window)``) charged in place as the
        reader's ``grad_sum`` role says. The penalty outweighs the shared synchronisation of
        the largest of the parameter's reads whole (a read through a cast may move more bytes
        than this one; one split on another axis, fewer): its gradient's sum where the token
        replicates it, its gather, reduce-scatter and re-gather where the token splits it
        (on a message of its own, the dearest per byte)."""
        pens = {}
        for pc, ((tok, sf), r) in enumerate(ukeys):
            if r == grad_sum.AS_IS:
                continue
            if tok not in pens:
                f, b = axis_reshard_phases(self.cm, a, tok, REPLICATE, pen_bytes, True, True, regather=True,
                                           messages=(self.bucket_bytes, 0.0))
                copy_s = sum(param_copy_phases(self.cm, a, tok, REPLICATE, pen_bytes, True, True, regather=True,
                                               kept_bucket=bool(self.memory.kept_buckets)))
                pens[tok] = grad_sum.penalty(f + b, copy_s, self.cm.overlap_slowdown)
            for qc, (q, split, _) in enumerate(vkeys):
                cost[pc, qc] = grad_sum.charge(cost[pc, qc], r, grad_sum.needs_sum(tok, q, split, rg), pens[tok])

    def _consumer_window_classes(self, strategies, i, win):
        """Per axis: consumers alike on that axis for operand i (token, work split) and in
        the compute the operand's synchronisation may hide behind share a class."""
        rows = [(s.ins[i], s.split_axes(), w) for s, w in zip(strategies, win)]
        return [_classes([(p[a], sp[a], w) for p, sp, w in rows]) for a in range(len(self.mesh))]

    def _axis_edge(self, place, nbytes, rg, strategies, i, a, replayed=False, tails=None):
        # On axis a the cost sees only the producer's token there and how finely the
        # other axes cut the tensor (and, with ``tails``, the compute since the ranks met
        # there), and the consumer's token and work split there.
        ucls, ucls_keys = self._producer_axis_classes(place, tails)[a]
        vcls, vcls_keys = self._shared_result(("vcls", id(strategies), i), lambda: self._consumer_classes(
            strategies, i))[a]
        # Edges of many operands see the same class keys on an axis: one table for all.
        # (Axes of one signature cost alike: they share tables and costs.)
        sig = self.cm.axis_signature(a)
        key = (sig, tuple(ucls_keys), tuple(vcls_keys), nbytes, rg, replayed)
        merged = self._axis_tables.get(key)
        if merged is None:
            table = {}
            memo = self._reshard
            for pc, ukey in enumerate(ucls_keys):
                (tok, sf), since = ukey if tails is not None else (ukey, None)
                for qc, (q, split) in enumerate(vcls_keys):
                    k = (sig, tok, q, nbytes / sf, split, rg, replayed, since)
                    c = memo.get(k)
                    if c is None:
                        c = memo[k] = axis_reshard(self.cm, a, tok, q, nbytes / sf, split, rg, replayed, since)
                    if c:
                        table[(pc, qc)] = c
            merged = self._axis_tables[key] = _merge_classes(len(ucls_keys), len(vcls_keys), table)
        rmap, cmap, table = merged
        return tuple([rmap[c] for c in ucls]), tuple([cmap[c] for c in vcls]), table

    def _producer_classes(self, place, tails=None):
        """Per axis: producers alike on that axis (its token, and how finely the other
        axes cut the tensor) share a class. With ``tails`` (``meets``: per producer choice,
        per axis the compute since the ranks met there, or None), a class key is
        ``((token, split), tail)``."""
        memo = self._axis_keys
        rows = []
        for p in place:
            k = memo.get(p)
            if k is None:
                f = [n if t[0] in "SBXW" else 1 for t, n in zip(p, self.mesh)]
                total = math.prod(f)
                k = memo[p] = tuple([(t, total // fa) for t, fa in zip(p, f)])
            rows.append(k)
        if tails is not None:
            return [_classes([(r[a], t[a] if t is not None else None) for r, t in zip(rows, tails)])
                    for a in range(len(self.mesh))]
        return [_classes([r[a] for r in rows]) for a in range(len(self.mesh))]

    def _producer_axis_classes(self, place, tails=None):
        """:meth:`_producer_classes`, once per placement list (and tails)."""
        if tails is None:
            return self._shared_result(("ucls", id(place)), lambda: self._producer_classes(place))
        return self._shared_result(("ucls-met", id(place), id(tails)), lambda: self._producer_classes(place, tails))

    def _consumer_classes(self, strategies, i):
        """Per axis: consumers alike on that axis for operand i (the token they need
        there, and whether they split their work there) share a class."""
        rows = [(s.ins[i], s.split_axes()) for s in strategies]
        return [_classes([(p[a], sp[a]) for p, sp in rows]) for a in range(len(self.mesh))]

    def _saved_memory(self):
        """Activations kept for backward, charged to the group of the tensor's owner; those
        only the head's ops keep are freed by the head's backward, before the last layer's
        began (taken off that phase, ``_Group.bwd_mem``). A plan that recomputes the layers
        keeps only what ops outside them save and each layer's inputs
        (``GraphFacts.kept_saved``); the last layer's replay saves its own again for its
        backward (``replay_saved``, that phase)."""
        f = self.facts
        saved, head = (f.kept_saved, f.kept_head_saved) if self.recompute else (f.saved_uses, f.head_saved)
        for it in list(saved) + ([x for x in f.replay_saved if x not in saved] if self.recompute else []):
            val = it.node.meta["val"]
            place, nbytes = self.place[it], val.numel() * val.element_size()
            local = self._shared_result(("local", id(place), nbytes), lambda: np.array(
                [self.memory.saved_bytes(nbytes, shard_factor(p, self.mesh)) for p in place]))
            replayed = local
            if self.selective and it in f.replay_saved and it.kind == "decision" and it in f.layer_items:
                # an output selective recomputation keeps is held from forward (``_selective_kept``):
                # the replay's savers read that copy, none of their own
                replayed = local * np.array([not kept_when_selective(it.node, s.kind)
                                             for s in self.groups[it.group].strategies])
            self.groups[it.group].mem += saved[it] * local
            self.groups[it.group].bwd_mem += (f.replay_saved[it] if self.recompute else 0) * replayed - head[it] * local
            self.groups[it.group].head_mem -= head[it] * local

    # ---------------------------------------------------------------- build
    def _check_force_patterns(self) -> None:
        """A ``Hints.force`` pattern that matched no node the solver decides, but matches nodes
        whose placement follows their inputs (views, unary ops, elementwise ops of one group's
        values), or only tied copies of an earlier layer's nodes (planned through the first
        layer's): the hint would silently do nothing, so it is an error naming the fix."""
        for k, (pattern, _) in enumerate(self.hints.force):
            if k in self._force_hits:
                continue
            matched = [n for n in self.graph.nodes if n.op == "call_function"
                       and any(re.search(pattern, key) for key in (n.name, n.meta.get("module", "")))]
            tied = [n for n in matched if (it := self.facts.node_item.get(n)) is not None and it.kind == "decision"]
            if tied:  # decided, but through the first of the identical layers it is tied to
                raise HintUnsatisfiable(
                    f"hint {pattern!r} matches only copies of a layer tied to an earlier identical one "
                    f"({', '.join(n.name for n in tied[:4])}; {tied[0].name} at "
                    f"{tied[0].meta.get('source') or 'an unknown line'}), whose strategy is planned once for all of "
                    "them, on the first: it would do nothing. Fix: a pattern that matches the first layer's node "
                    "too (e.g. the module path without its layer index)")
            names = [n.name for n in matched]
            if names:
                first = matched[0]
                raise HintUnsatisfiable(
                    f"hint {pattern!r} matches only nodes whose placement follows their inputs ({', '.join(names[:4])}"
                    f"{', ...' if len(names) > 4 else ''}; {names[0]} at {first.meta.get('source') or 'an unknown line'}"
                    "), which the solver does not decide: it would do nothing. Fix: force the node that feeds them "
                    "(its producer: a linear, a norm, an add of two values)")

    def build(self, budget: float | None, edges: bool = True) -> Problem:
        """The solver problem; with ``edges=False`` only its groups (enough for
        ``solver.min_memory_bound``; ``solver.min_memory`` needs the memory edges too,
        ``add_memory_edges``). ``add_edges`` completes it."""
        self.budget = budget
        for it in self.facts.items:
            if it.kind in ("param", "input"):
                self._placeholder(it)
            elif it.kind == "decision":
                self._decision(it)
            elif it.kind == "follower":
                self._follower(it)
            else:
                self._derived(it)
        self._check_force_patterns()
        self._saved_memory()
        problem = Problem(cost=[np.rint(g.cost * NS).astype(np.int64).tolist() for g in self.groups],
                          mem=[np.rint(g.mem).astype(np.int64).tolist() for g in self.groups],
                          transient=[[int(round(t)) for t in g.transient] for g in self.groups],
                          budget=None if budget is None else int(budget),
                          step_mem=[np.rint(g.step_mem).astype(np.int64).tolist() for g in self.groups],
                          step_transient=[[int(round(t)) for t in g.step_transient] for g in self.groups],
                          bwd_mem=[np.rint(g.bwd_mem).astype(np.int64).tolist() for g in self.groups],
                          bwd_transient=[[int(round(t)) for t in (g.bwd_transient or [0.0] * len(g.transient))]
                                         for g in self.groups],
                          head_mem=[np.rint(g.head_mem).astype(np.int64).tolist() for g in self.groups]
                          if self.facts.head else None)
        return self.add_edges(problem) if edges else problem

    def add_memory_edges(self, problem: Problem) -> Problem:
        kept_held, kept_freed = self._kept_head_edges()
        read_held, read_freed = self._saved_read_edges()
        problem.mem_edges = self._regather_edges() + kept_freed + read_freed
        problem.head_edges = self._head_reduction_edges() + kept_freed + read_freed
        problem.saved_edges = self._saved_edges() + kept_held + read_held
        problem.transient_edges = self._transient_edges()
        return problem

    def add_edges(self, problem: Problem) -> Problem:
        problem.edges = self._solver_edges()
        problem.shares = self._shares()
        return self.add_memory_edges(problem)

    # ---------------------------------------------------------------- read back
    def to_plan(self, choice: list[int], sol, problem: Problem, meta: dict) -> Plan:
        nodes: dict[str, NodePlan] = {}
        edge_s = self._edge_seconds(choice)
        rep_out = [REPLICATE] * len(self.mesh)
        done: dict = {}  # item -> its NodePlan fields (tied copies differ only in tied_to)
        item_of, tie_of, const = self.facts.node_item.get, self.tie.get, self.const
        for node in self.graph.nodes:
            it = item_of(node)
            if it is None:
                if node in const and node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
                    nodes[node.name] = NodePlan("const", _op_name(node), "spatial", list(rep_out))
                continue
            f = done.get(it)
            if f is None:
                f = done[it] = self._node_fields(it, choice[it.group], edge_s)
            role, op, kind, out, ins, axis, time_s, comm_s, mem = f
            tied = tie_of(node) if op != "placeholder" else None
            nodes[node.name] = NodePlan(role, op, kind, list(out), [list(p) for p in ins], axis, time_s, comm_s, mem,
                                        tied.name if tied else "")
        return Plan(model=self.tg.model_name, mesh_shape=list(self.mesh), cluster=self.cm.cluster.name,
                    dtype=meta.get("dtype", "fp32"), budget_bytes=meta.get("budget"), nodes=nodes,
                    modelled_step_time_s=sol.objective_ns / NS, peak_memory_bytes=float(sol.peak_bytes),
                    stats={**meta.get("stats", {}), **({"keep_gathered": sorted(self.hints.keep_gathered)} if self.hints.keep_gathered else {}),
                           **({"recompute": self.hints.recompute} if self.recompute else {}),
                           **({"recompute_layers": self.facts.recompute_layers}
                              if self.recompute and self.facts.recompute_layers is not None else {}),
                           **({"recompute_kept": self._selective_names(choice)} if self.selective else {})},
                    alternatives=self._alternatives(choice))

    def _node_fields(self, it: Item, c: int, edge_s: dict) -> tuple:
        """(role, op, kind, out, ins, axis, time_s, comm_s, mem_bytes) of item ``it`` under
        choice c (every node of an item runs one op)."""
        grp = self.groups[it.group]
        if it.kind in ("param", "input"):  # a parameter's time: its optimizer step (+ a skewed weight's relayout)
            comm = 0.0
            if it.kind == "param":
                val = it.node.meta["val"]
                comm = grid_relayout_s(self.cm, self.place[it][c], val.numel() * val.element_size(), it.node in self.rg)
            return (it.kind, "placeholder", "spatial", self.place[it][c], (), -1, float(grp.own_cost[c]) - comm, comm,
                    float(grp.own_mem[c]))
        op = _op_name(it.node)
        if it.kind == "derived":  # planned through its operand; to the passes a decision like any other
            s = self.derived[it][c]
            return "decision", op, s.kind, s.out, s.ins, -1, float(self.extra[it][c]), 0.0, 0.0
        if it.kind == "decision":
            s = grp.strategies[c]
            return ("decision", op, s.kind, s.out, s.ins, s.axis, grp.own_cost[c], edge_s.get(it, 0.0),
                    float(grp.own_mem[c]))   # (the blocks the op keeps for backward: costs.stash_bytes)
        # the input placement it reads where it cannot keep its source's, other than Replicate
        # (no input listed: it keeps its source's, or reads it gathered)
        via = self.follow_via[it][c]
        ins = (via,) if via != self.place[it.operands[0]][c] and any(t != REPLICATE for t in via) else ()
        return "follower", op, "spatial", self.place[it][c], ins, -1, float(self.extra[it][c]), 0.0, 0.0

    def _edge_seconds(self, choice) -> dict:
        """Per consumer item: modelled seconds of its input edges (one copy's worth); a
        shared reshard is shown on the first consumer (in graph order) that needs it."""
        out = defaultdict(float)
        for (src, dst, i), edges in self._edge_cache.items():
            for ucls, vcls, table in edges:
                out[dst] += table.get((ucls[choice[src.group]], vcls[choice[dst.group]]), 0.0)
        for sr, (seconds, keys) in zip(self.facts.shared, self._share_costs):
            row, paid = seconds[choice[sr.src.group]], set()
            for (dst, _), ks in sorted(zip(sr.uses, keys), key=lambda t: self._order(t[0][0])):
                k = int(ks[choice[dst.group]])
                if k not in paid:
                    paid.add(k)
                    out[dst] += float(row[k])
        return out

    def _order(self, it: Item) -> int:
        """An item's place in graph order (``GraphFacts.items`` is in graph order)."""
        if self._item_order is None:
            self._item_order = {x: k for k, x in enumerate(self.facts.items)}
        return self._item_order[it]

    def _share_marginals(self, choice) -> dict:
        """Per consumer item of a shared read: seconds of that input under each of its
        choices, the other consumers as planned (0 for a placement another one reads)."""
        out = {}
        for sr, (seconds, keys) in zip(self.facts.shared, self._share_costs):
            row = seconds[choice[sr.src.group]]
            for j, (dst, _) in enumerate(sr.uses):
                taken = {int(ks[choice[d.group]]) for (d, _), ks in zip(sr.uses, keys) if d is not dst}
                out[dst] = np.where(np.isin(keys[j], list(taken)), 0.0, row[keys[j]])
        return out

    def settle_modes(self, choice: list[int], problem: Problem) -> tuple[list[int], int]:
        """``choice`` with each parameter that has ``grad_sum`` modes in its cheapest mode for
        the placement chosen, every other group as chosen, and the ns that saves. An exact
        solve has it so already; one cut short (a time limit, an incumbent) may have left a
        mode that pays a penalty. Modes change no memory: only the parameter's edges count."""
        if not self._sum_modes:
            return choice, 0
        edges = defaultdict(list)
        for e in problem.edges:
            if e.u in self._sum_modes:
                edges[e.u].append(e)
        choice, saved = list(choice), 0
        for g in self._sum_modes:
            place = self.groups[g].strategies

            def charged(c):
                return problem.cost[g][c] + sum(e.table.get((e.ucls[c], e.vcls[choice[e.v]]), 0) for e in edges[g])
            best = min((c for c, p in enumerate(place) if p == place[choice[g]]), key=charged)
            saved += charged(choice[g]) - charged(best)
            choice[g] = best
        return choice, saved

    def _moded_alternatives(self, u: int, it: Item, choice, reads) -> np.ndarray:
        """Per choice of reader ``it``: what parameter ``u``'s edges (``reads``: (reader,
        per-axis edge) of all its readers) cost beyond the other readers' as planned, ``u`` in
        its cheapest mode for its planned placement given that choice (``grad_sum``: a
        reader that stops needing the sum hands it on, not a penalty)."""
        place = self.groups[u].strategies
        n = len(self.groups[it.group].strategies)
        best = np.full(n, np.inf)
        for m in (c for c, p in enumerate(place) if p == place[choice[u]]):
            total = np.zeros(n)
            for d, (ucls, vcls, table) in reads:
                if d is it:
                    total += _edge_row(ucls[m], vcls, table)
                else:
                    total += table.get((ucls[m], vcls[choice[d.group]]), 0.0)
            best = np.minimum(best, total)
        others = sum(table.get((ucls[choice[u]], vcls[choice[d.group]]), 0.0)
                     for d, (ucls, vcls, table) in reads if d is not it)
        return best - others

    def _alternatives(self, choice, top: int = 6) -> dict:
        """For each representative decision node: its strategies ranked by node cost plus
        input-edge cost with every neighbour as planned (one copy of the node)."""
        res = {}
        by_consumer, by_reader = defaultdict(list), defaultdict(list)
        for (src, dst, i), edges in self._edge_cache.items():
            for val in edges:
                by_consumer[dst].append((src.group, val))
                if src.group in self._sum_modes:
                    by_reader[src.group].append((dst, val))
        marginal = self._share_marginals(choice)
        for it in self.facts.group_items:
            grp = self.groups[it.group]
            if it.kind != "decision" or len(grp.strategies) < 2:
                continue
            scored = np.array(grp.own_cost, dtype=float)
            if it in marginal:
                scored += marginal[it]
            moded = set()
            for u, (ucls, vcls, table) in by_consumer[it]:
                if u == it.group:  # the node feeds itself (both operands one tensor)
                    scored += [table.get((ucls[c], vcls[c]), 0.0) for c in range(len(scored))]
                    continue
                if u in self._sum_modes:
                    moded.add(u)
                    continue
                scored += _edge_row(ucls[choice[u]], vcls, table)  # the producer as planned: one row
            for u in moded:
                scored += self._moded_alternatives(u, it, choice, by_reader[u])
            # rank by (time, description) the strategies at or below the top-th time
            cut = np.partition(scored, top - 1)[top - 1] if len(scored) > top else np.inf
            desc = {c: grp.strategies[c].describe() for c in np.flatnonzero(scored <= cut).tolist()}
            keep = sorted(desc, key=lambda c: (scored[c], desc[c]))[:top]
            chosen = grp.strategies[choice[it.group]].describe()
            if chosen not in [desc[c] for c in keep]:  # its best-scored strategy of that description
                keep.append(min((c for c, s in enumerate(grp.strategies) if s.describe() == chosen),
                                key=lambda c: scored[c]))
            res[it.node.name] = [(grp.strategies[c].describe(), float(scored[c])) for c in keep]
        return res


def _edge_row(row: int, vcls, table: dict) -> np.ndarray:
    """An edge's cost per consumer choice, its producer in class ``row``."""
    per_class = np.array([table.get((row, q), 0.0) for q in range(max(vcls) + 1)])
    return per_class[np.asarray(vcls)]


def _op_name(node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _classes(keys) -> tuple[tuple[int, ...], list]:
    """Number distinct keys in first-seen order: (class per item, key per class)."""
    seen: dict = {}
    return tuple([seen.setdefault(k, len(seen)) for k in keys]), list(seen)


def _merge_classes(num_rows: int, num_cols: int, table: dict):
    """Classes whose cost rows (columns) are identical are interchangeable for the solver:
    merge them so the edge has as few class pairs as its costs really distinguish.
    Returns (new row class per old one, new column class per old one, the merged table)."""
    P, Q = range(num_rows), range(num_cols)
    first: dict = {}
    rmap = [first.setdefault(tuple([table.get((p, q), 0.0) for q in Q]), p) for p in P]
    first = {}
    cmap = [first.setdefault(tuple([table.get((p, q), 0.0) for p in P]), q) for q in Q]
    pr = {p: i for i, p in enumerate(sorted(set(rmap)))}
    qr = {q: i for i, q in enumerate(sorted(set(cmap)))}
    rows, cols = [pr[r] for r in rmap], [qr[c] for c in cmap]
    return rows, cols, {(rows[p], cols[q]): c for (p, q), c in table.items()}


def _merge_dense(table: np.ndarray):
    """:func:`_merge_classes` of a table given as a dense int matrix (0: no cost): the same
    classes, in the same (first-seen) order, and the same merged table of nonzero pairs."""
    def merged(m: np.ndarray) -> tuple[list[int], np.ndarray]:
        """(class per row, the first row of each class in class order)"""
        _, first, inverse = np.unique(m, axis=0, return_index=True, return_inverse=True)
        firsts = first[inverse.reshape(-1)]       # each row's first identical row
        reps = np.sort(first)
        order = {r: n for n, r in enumerate(reps.tolist())}
        return [order[r] for r in firsts.tolist()], reps

    (rows, rrep), (cols, crep) = merged(table), merged(table.T)
    small = table[np.ix_(rrep, crep)]  # one entry per pair of classes
    nz = np.nonzero(small)
    return rows, cols, {(p, q): int(small[p, q]) for p, q in zip(nz[0].tolist(), nz[1].tolist())}


def build_problem(tg: TracedGraph, cm: CostModel, budget: float | None = None, hints: Hints | None = None,
                  memory: MemoryModel | str = "fp32-adam", facts: GraphFacts | None = None,
                  edges: bool = True) -> tuple[Builder, Problem]:
    """The solver problem of one traced graph on one mesh shape (``cm.mesh_shape``);
    ``memory``: the :class:`MemoryModel` (or just its optimizer layout) it is charged with."""
    b = Builder(tg, cm, hints, memory, facts)
    return b, b.build(budget, edges)


def make_plan(b: Builder, problem: Problem, sol: Solution, build_time_s: float, dtype: str = "fp32") -> Plan:
    """Read a solution of ``b``'s problem back as a Plan, with its solve statistics."""
    stats = {"build_time_s": build_time_s, "solve_time_s": sol.solve_time_s, "status": sol.status,
             "method": sol.method, "num_groups": len(problem.cost), "num_variables": sol.num_variables,
             "num_constraints": sol.num_constraints, "num_nodes": len(b.graph.nodes),
             "tied_nodes": len(b.tie), "fallback_ops": dict(b.fallback), "hints": b.hints.name,
             "optimizer": {"layout": b.memory.layout, "impl": b.memory.optimizer_impl},
             # (the runtime keeps its data-parallel gradient buckets between steps: MemoryModel)
             "keep_grad_buckets": bool(b.memory.kept_buckets),
             # (the buckets' size it was costed with; None: none, each gradient summed where made)
             "grad_bucket_bytes": b.memory.grad_bucket_bytes}
    choice, saved = b.settle_modes(sol.choice, problem)
    if saved:
        sol = replace(sol, choice=choice, objective_ns=sol.objective_ns - saved)
    plan = b.to_plan(sol.choice, sol, problem, {"dtype": dtype, "budget": b.budget, "stats": stats})
    plan.stats["strategy_counts"] = plan.strategy_counts()
    if not b.recompute:  # (under recomputation no saved tensor is relieved jointly)
        plan.stats["jointly_saved_bytes"] = b.jointly_saved_bytes({k: n.kind for k, n in plan.nodes.items()})
    plan.attach(b, problem, sol)  # the problem, for plan.explain's re-solves (not serialised, not hashed)
    return plan


def plan_graph(tg: TracedGraph, cm: CostModel, budget: float | None = None, hints: Hints | None = None,
               memory: MemoryModel | str = "fp32-adam", dtype: str = "fp32", cap_s: float | None = None,
               facts: GraphFacts | None = None) -> Plan:
    """Plan one traced graph on one mesh shape (``cm.mesh_shape``). With ``cap_s``,
    raise ``solver.NoBetterPlan`` unless a plan of at most that modelled time exists."""
    t0 = time.perf_counter()
    b, problem = build_problem(tg, cm, budget, hints, memory, facts)
    if cap_s is not None:
        problem.cap = int(cap_s * NS)
    t1 = time.perf_counter()
    return make_plan(b, problem, solve(problem), t1 - t0, dtype)
