"""The solver (elimination first, CP-SAT where the budget binds; and CP-SAT alone)
against exhaustive enumeration on random problems."""
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from _oracles import brute_force  # noqa: E402
from stpc.planner.solver import Edge, InfeasibleBudget, Problem, solve  # noqa: E402


@st.composite
def problems(draw, with_budget=False):
    n = draw(st.integers(1, 5))
    k = [draw(st.integers(1, 4)) for _ in range(n)]
    cost = [[draw(st.integers(0, 50)) for _ in range(c)] for c in k]
    mem = [[draw(st.integers(0, 20)) for _ in range(c)] for c in k]
    tr = [[draw(st.integers(0, 20)) for _ in range(c)] for c in k]
    edges = []
    for _ in range(draw(st.integers(0, 6))):
        u = draw(st.integers(0, n - 1))
        v = draw(st.integers(0, n - 1))
        nu, nv = draw(st.integers(1, k[u])), draw(st.integers(1, k[v]))
        ucls = tuple(draw(st.integers(0, nu - 1)) for _ in range(k[u]))
        vcls = tuple(draw(st.integers(0, nv - 1)) for _ in range(k[v]))
        table = {(p, q): draw(st.integers(0, 40)) for p in range(nu) for q in range(nv)}
        edges.append(Edge(u, v, ucls, vcls, table))
    budget = draw(st.integers(0, 100)) if with_budget else None
    bwd_mem, mem_edges, bwd_tr = None, [], None
    if draw(st.booleans()):  # the last layer's backward: more per choice, and per pair of choices
        bwd_mem = [[draw(st.integers(0, 10)) for _ in range(c)] for c in k]
        if draw(st.booleans()):  # its own working sets (else the forward's)
            bwd_tr = [[draw(st.integers(0, 20)) for _ in range(c)] for c in k]
        for _ in range(draw(st.integers(0, 3))):
            u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
            ucls, vcls = tuple(range(k[u])), tuple(range(k[v]))
            mem_edges.append(Edge(u, v, ucls, vcls, {(p, q): draw(st.integers(0, 15)) for p in ucls for q in vcls}))
    head_mem, head_edges = None, []
    if draw(st.booleans()):  # the head's gradient reduction: less or more per choice, more per pair
        head_mem = [[draw(st.integers(-10, 10)) for _ in range(c)] for c in k]
        for _ in range(draw(st.integers(0, 2))):
            u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
            ucls, vcls = tuple(range(k[u])), tuple(range(k[v]))
            head_edges.append(Edge(u, v, ucls, vcls, {(p, q): draw(st.integers(0, 15)) for p in ucls for q in vcls}))
    saved_edges = []
    for _ in range(draw(st.integers(0, 2))):  # a saved tensor its one saver may not keep: negative
        u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        ucls, vcls = tuple(range(k[u])), tuple(draw(st.integers(0, 1)) for _ in range(k[v]))
        saved_edges.append(Edge(u, v, ucls, vcls, {(p, 1): -draw(st.integers(0, min(mem[u]) if u != v else 0))
                                                   for p in ucls}))
    transient_edges = []
    for _ in range(draw(st.integers(0, 2))):  # a consumer's working set grows where its operand is resharded
        u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        ucls, vcls = tuple(range(k[u])), tuple(range(k[v]))
        transient_edges.append(Edge(u, v, ucls, vcls, {(p, q): draw(st.integers(0, 15)) for p in ucls for q in vcls}))
    return Problem(cost=cost, mem=mem, transient=tr, edges=edges, budget=budget, bwd_mem=bwd_mem,
                   mem_edges=mem_edges, bwd_transient=bwd_tr, head_mem=head_mem, head_edges=head_edges,
                   saved_edges=saved_edges, transient_edges=transient_edges)


@pytest.mark.parametrize("method", ["auto", "cpsat"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_cpsat_equals_brute_force(p, method):
    sol = solve(p, method=method)
    best, _ = brute_force(p)
    assert sol.objective_ns == best
    assert p.evaluate(sol.choice)[0] == best


@pytest.mark.parametrize("method", ["auto", "cpsat"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems(with_budget=True))
def test_cpsat_equals_brute_force_under_budget(p, method):
    best = brute_force(p)
    if best is None:
        with pytest.raises(InfeasibleBudget) as err:
            solve(p, method=method)
        # The reported minimum is exactly the smallest peak of any assignment.
        assert err.value.min_budget == min(
            p.evaluate(list(c))[1] for c in __import__("itertools").product(*(range(len(c)) for c in p.cost)))
        assert err.value.min_budget > p.budget
    else:
        sol = solve(p, method=method)
        assert sol.objective_ns == best[0]
        assert sol.peak_bytes <= p.budget


@pytest.mark.parametrize("method", ["auto", "cpsat"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_objective_cap_prunes_exactly(p, method):
    from stpc.planner.solver import NoBetterPlan
    best, _ = brute_force(p)
    p.cap = best - 1
    with pytest.raises(NoBetterPlan):
        solve(p, method=method)
    p.cap = best
    assert solve(p, method=method).objective_ns == best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems(with_budget=True), data=st.data())
def test_hint_leaves_the_optimum(p, data):
    """A hint (any choice per group, fitting or not) only says where CP-SAT starts: the
    budgeted optimum, or the infeasibility, is what brute force finds."""
    hint = [data.draw(st.integers(0, len(c) - 1)) for c in p.cost]
    best = brute_force(p)
    if best is None:
        with pytest.raises(InfeasibleBudget):
            solve(p, method="cpsat", hint=hint)
        return
    sol = solve(p, method="cpsat", hint=hint)
    assert sol.objective_ns == best[0] and sol.peak_bytes <= p.budget


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(with_budget=True))
def test_objective_cap_under_budget(p):
    """CP-SAT's cap (the objective's domain) where the budget binds too: a cap one below
    the budgeted optimum proves no plan reaches it, the optimum itself is found."""
    from stpc.planner.solver import NoBetterPlan
    best = brute_force(p)
    if best is None:
        return
    p.cap = best[0] - 1
    with pytest.raises(NoBetterPlan):
        solve(p, method="cpsat")
    p.cap = best[0]
    sol = solve(p, method="cpsat")
    assert sol.objective_ns == best[0] and sol.peak_bytes <= p.budget


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(with_budget=True))
def test_pruning_keeps_the_optimum(p):
    from stpc.planner.solver import prune_dominated
    q, keep = prune_dominated(p)
    assert all(len(k) >= 1 for k in keep)
    a, b = brute_force(p), brute_force(q)
    assert (a is None) == (b is None)
    if a is not None:
        assert a[0] == b[0]


def test_a_transient_edge_adds_to_its_consumers_working_set_only_at_its_pair():
    # group 0 (a producer: keep the layout, or reshard for group 1) and group 1 (the loss):
    # under the pair (1, 0) the loss's working set grows by 7 on top of its own 5
    p = Problem(cost=[[3, 0], [0]], mem=[[10, 10], [0]], transient=[[0, 6], [5]],
                transient_edges=[Edge(0, 1, (0, 1), (0,), {(1, 0): 7})])
    assert p.forward_transients([0, 0]) == [0, 5] and p.forward_transients([1, 0]) == [6, 12]
    assert p.evaluate([0, 0]) == (3, 15) and p.evaluate([1, 0]) == (0, 22)
    assert solve(p).choice == [1, 0]  # no budget: the cheaper choice, whatever it holds
    for method in ("auto", "cpsat"):  # a budget between the two: only the pair without the copy fits
        p.budget = 20
        assert solve(p, method=method).choice == [0, 0]
        p.budget = 14
        with pytest.raises(InfeasibleBudget) as e:
            solve(p, method=method)
        assert e.value.min_budget == 15
