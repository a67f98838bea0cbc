"""A reshard several consumers share is paid once: the solver (elimination with the
star step, CP-SAT) against exhaustive enumeration on random problems, and a planned
graph whose producer feeds three consumers against an explicit recomputation."""
import itertools
import re
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from _oracles import brute_force  # noqa: E402
from stpc import trace  # noqa: E402
from stpc.cost_models import GRAD_BUCKET_BYTES, CostModel, get_cluster  # noqa: E402
from stpc.planner import Hints, plan_graph  # noqa: E402
from stpc.placement import shard_factor  # noqa: E402
from stpc.planner.costs import axis_reshard_phases, param_copy_phases, reshard_cost  # noqa: E402
from stpc.planner.sharing import Share, partitions  # noqa: E402
from stpc.planner.solver import Edge, Problem, solve, solve_unconstrained  # noqa: E402
from stpc.planner.strategies import Strategy, tensor_operands  # noqa: E402


def _edge(draw, u, v, k, hi=40):
    nu, nv = draw(st.integers(1, k[u])), draw(st.integers(1, k[v]))
    ucls = tuple(draw(st.integers(0, nu - 1)) for _ in range(k[u]))
    vcls = tuple(draw(st.integers(0, nv - 1)) for _ in range(k[v]))
    return Edge(u, v, ucls, vcls, {(p, q): draw(st.integers(0, hi)) for p in range(nu) for q in range(nv)})


def _share(draw, u, vs, k):
    nkeys = draw(st.integers(1, 4))
    rows = draw(st.integers(1, k[u]))
    ucls = np.array([draw(st.integers(0, rows - 1)) for _ in range(k[u])])
    keys = tuple(np.array([draw(st.integers(0, nkeys - 1)) for _ in range(k[v])]) for v in vs)
    cost = np.array([[draw(st.integers(0, 60)) for _ in range(nkeys)] for _ in range(rows)], dtype=np.int64)
    return Share(u, tuple(vs), ucls, keys, cost)


@st.composite
def star_problems(draw, with_budget=False):
    """A producer 0 (with a neighbour upstream), 2-4 consumers, each with a leaf (its
    weight), all joined to one group S (or to none), and a share over the consumers."""
    nc = draw(st.integers(2, 4))
    common = draw(st.booleans())
    consumers = list(range(1, nc + 1))
    s = nc + 1 if common else None
    up = nc + 2
    leaves = list(range(nc + 3, nc + 3 + nc))
    n = nc + 3 + nc
    k = [draw(st.integers(1, 3)) for _ in range(n)]
    edges = [_edge(draw, up, 0, k)]
    for v, leaf in zip(consumers, leaves):
        edges.append(_edge(draw, leaf, v, k))
        if s is not None and draw(st.integers(0, 3)):  # (now and then a consumer without one)
            edges.append(_edge(draw, v, s, k) if draw(st.booleans()) else _edge(draw, s, v, k))
    if s is not None and draw(st.booleans()):
        edges.append(_edge(draw, 0, s, k))  # the producer also meets S directly
    cost = [[draw(st.integers(0, 30)) for _ in range(c)] for c in k]
    mem = [[draw(st.integers(0, 20)) for _ in range(c)] for c in k]
    budget = draw(st.integers(0, 150)) if with_budget else None
    return Problem(cost=cost, mem=mem, edges=edges, shares=[_share(draw, 0, consumers, k)], budget=budget)


@st.composite
def any_share_problems(draw):
    """Shares anywhere (not stars): elimination gives way to CP-SAT, still exact."""
    n = draw(st.integers(3, 5))
    k = [draw(st.integers(1, 3)) for _ in range(n)]
    edges = [_edge(draw, draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1)), k)
             for _ in range(draw(st.integers(0, 4)))]
    vs = draw(st.lists(st.integers(1, n - 1), min_size=2, max_size=3, unique=True))
    return Problem(cost=[[draw(st.integers(0, 30)) for _ in range(c)] for c in k], edges=edges,
                   shares=[_share(draw, 0, vs, k)])


def test_share_value_counts_each_distinct_key_once():
    sh = Share(0, (1, 2, 3), np.array([0, 1]), (np.array([0, 1]),) * 3, np.array([[5, 7], [0, 3]]))
    assert sh.value([0, 0, 0, 0]) == 5          # three consumers, one key: once
    assert sh.value([0, 0, 1, 0]) == 5 + 7      # two keys
    assert sh.value([1, 1, 1, 1]) == 3


def test_partitions_are_the_bell_numbers():
    assert [len(partitions(k)) for k in range(1, 5)] == [1, 2, 5, 15]
    for p in partitions(4):
        assert sorted(i for b in p for i in b) == [0, 1, 2, 3]


@pytest.mark.parametrize("method", ["auto", "cpsat"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=star_problems())
def test_star_share_equals_brute_force(p, method):
    best, _ = brute_force(p)
    sol = solve(p, method=method)
    assert sol.objective_ns == best == p.evaluate(sol.choice)[0]
    if method == "auto":
        assert sol.method == "elimination"   # a star never needs CP-SAT


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=star_problems(with_budget=True))
def test_star_share_under_budget_equals_brute_force(p):
    best = brute_force(p)
    if best is None:
        return
    sol = solve(p)
    assert sol.objective_ns == best[0] and sol.peak_bytes <= p.budget


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=any_share_problems())
def test_any_share_equals_brute_force(p):
    best, _ = brute_force(p)
    assert solve(p).objective_ns == best


def test_three_consumers_one_gather():
    """Producer with two placements (0: split, 1: replicated), three consumers that each
    prefer to read it replicated (key 1; key 0 reads it as it is): charged once, the
    gather (10) beats three reads of the split layout (3 x 4) though it does not beat one."""
    cost = np.array([[0, 10], [0, 0]], dtype=np.int64)  # split -> key 1 costs a gather
    keys = (np.array([0, 1]),) * 3
    consumer = [4, 0]  # reading the split layout costs each consumer 4 (its own work)
    p = Problem(cost=[[0, 50]] + [consumer] * 3, shares=[Share(0, (1, 2, 3), np.array([0, 1]), keys, cost)])
    assert solve_unconstrained(p) == [0, 1, 1, 1]
    assert p.evaluate([0, 1, 1, 1])[0] == 10
    # without sharing (each pays its own gather) the split reads would win: 12 < 30
    apart = Problem(cost=[[0, 50]] + [[4, 10]] * 3)
    assert min(apart.evaluate(list(c))[0] for c in itertools.product(range(2), *[range(2)] * 3)) == 12


# --------------------------------------------------------------------------- on a graph


class Fan(nn.Module):
    """One producer (``pre``) read by three consumers (q, k, v), joined again by a cat."""

    def __init__(self, d=64):
        super().__init__()
        self.pre = nn.Linear(d, d, bias=False)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.pre(x)
        return torch.cat([self.q(h), self.k(h), self.v(h)], -1).sum()


def _fan_plan(mesh, hints=None):
    with torch.device("meta"):
        m = Fan()
    tg = trace(m, (torch.empty(8, 64, 64, device="meta"),), name="fan")
    # (a weight's synchronisation overlapped with compute is tested on its own, in
    # test_cost_models; slowdown 1 leaves every collective whole, as reshard_cost has it)
    cm = CostModel(get_cluster("primepar-v100"), mesh, overlap_slowdown=1.0)
    return tg, cm, plan_graph(tg, cm, hints=hints)


def _rounding(plan) -> float:
    """The solver's objective is integer nanoseconds, each node and edge term rounded:
    at most a nanosecond per node apart from the plain float sum."""
    return 1e-9 * len(plan.nodes)


def _layer_bytes(tg, param) -> float:
    """The bytes of every parameter of ``param``'s indexed module (``layers.3``): the one
    ZeRO collective its sync rides in at run time; 0 outside one."""
    m = re.match(r"^(.*?\.\d+)\.", tg.param_fqns[param.name])
    if not m:
        return 0.0
    return float(sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in tg.graph.nodes
                     if n.op == "placeholder" and n.name in tg.param_fqns
                     and tg.param_fqns[n.name].startswith(m.group(1) + ".")))


def _recomputed(tg, cm, plan, once=True):
    """The plan's step time from its placements alone: every node's own time plus, on
    every decision input, ``costs.reshard_cost`` from the producer's placement to the
    one the node reads; with ``once``, a reshard of one tensor to one (placement, work
    split) is counted once however many nodes read it."""
    facts, nodes = tg.facts, plan.nodes
    total = sum(n.time_s for n in nodes.values())
    seen = set()
    for node in tg.graph.nodes:
        it = facts.node_item.get(node)
        if it is None or it.kind != "decision":
            continue
        np_ = nodes[node.name]
        split = Strategy(tuple(np_.out), tuple(tuple(p) for p in np_.ins)).split_axes()
        for o, ins in zip(tensor_operands(node), np_.ins):
            if o not in facts.node_item:
                continue  # a constant: computed where it is needed
            key = (o.name, tuple(ins), split)
            if once and key in seen:
                continue
            seen.add(key)
            v = o.meta["val"]
            src, nbytes = tuple(nodes[o.name].out), v.numel() * v.element_size()
            if o.op == "placeholder" and o.name in tg.param_fqns:  # a weight: its sync as the runtime runs it
                for a in range(len(src)):  # (and the runtime's copies around it)
                    if src[a] != ins[a] or (ins[a] == "R" and split[a]):
                        sf = shard_factor(src, cm.mesh_shape, skip_axis=a)
                        args = (cm, a, src[a], ins[a], nbytes / sf, split[a], o in facts.rg)
                        messages = (GRAD_BUCKET_BYTES, _layer_bytes(tg, o) / sf)
                        total += sum(axis_reshard_phases(*args, regather=True, messages=messages))
                        total += sum(param_copy_phases(*args, regather=True))
            else:
                total += reshard_cost(cm, src, tuple(ins), nbytes, split, o in facts.rg)
    return total


def test_a_gather_three_consumers_share_is_charged_once():
    """Sequence-split producer, three column-parallel consumers that read it replicated:
    the modelled step pays the all-gather (and its backward reduce-scatter) once."""
    seq_split = Hints(force=[(r"^pre$", lambda s: s.kind == "spatial" and s.out == ("S1",)),
                             (r"^(q|k|v)$", lambda s: s.kind == "spatial" and s.ins == (("R",), ("S0",)))])
    tg, cm, plan = _fan_plan((4,), seq_split)
    lin = {n.meta["module"]: n for n in tg.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)}
    h = lin["pre"]
    assert all(plan.nodes[lin[m].name].ins[0] == ["R"] for m in "qkv")
    gather = reshard_cost(cm, ("S1",), ("R",), h.meta["val"].numel() * 4, (True,), True)
    assert gather > 0
    once, each = _recomputed(tg, cm, plan), _recomputed(tg, cm, plan, once=False)
    assert gather > 1e-6   # (far above the rounding of the objective, ``_rounding``)
    assert plan.modelled_step_time_s == pytest.approx(once, abs=_rounding(plan))
    assert each == pytest.approx(once + 2 * gather, rel=1e-9)
    # the gather is shown on the first consumer, the others read it free
    assert [plan.nodes[lin[m].name].comm_s > 0 for m in "qkv"] == [True, False, False]


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_solved_plan_time_equals_recomputation_with_shared_reshards(mesh):
    tg, cm, plan = _fan_plan(mesh)
    assert len(tg.facts.shared) == 1 and len(tg.facts.shared[0].uses) == 3
    assert plan.modelled_step_time_s == pytest.approx(_recomputed(tg, cm, plan), abs=_rounding(plan))
