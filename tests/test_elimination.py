"""Variable elimination against exhaustive enumeration; the exact memory minimum."""
import dataclasses
import itertools
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stpc.planner import solver
from stpc.planner.elimination import TooWide, eliminate
from stpc.planner.solver import (Edge, InfeasibleBudget, Problem, SolverTimeout, fits_memory, least_memory, min_memory,
                                 min_memory_bound, solve, solve_unconstrained)


def _brute(unary, pairs):
    """The minimum over every joint choice, enumerated whole: the table of all of them built
    by broadcasting (one axis per variable), each factor added along its own axes."""
    n = len(unary)
    total = np.zeros([len(u) for u in unary], dtype=np.int64)
    for a, u in enumerate(unary):
        total += np.asarray(u, dtype=np.int64).reshape([-1 if k == a else 1 for k in range(n)])
    for (a, b), m in pairs.items():
        m = np.asarray(m, dtype=np.int64) if a < b else np.asarray(m, dtype=np.int64).T  # axes in order
        shape = [1] * n
        shape[min(a, b)], shape[max(a, b)] = m.shape
        total += m.reshape(shape)
    return int(total.min())


@st.composite
def factor_graphs(draw):
    n = draw(st.integers(1, 7))
    dom = [draw(st.integers(1, 5)) for _ in range(n)]
    hi = draw(st.sampled_from([3, 1000]))  # few values: many equal rows, the class path
    unary = [np.array([draw(st.integers(0, hi)) for _ in range(d)]) for d in dom]
    pairs = {}
    for a, b in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            pairs[(a, b)] = np.array([[draw(st.integers(0, hi)) for _ in range(dom[b])] for _ in range(dom[a])])
    return unary, pairs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(factor_graphs())
def test_elimination_equals_brute_force(fg):
    unary, pairs = fg
    value, choice = eliminate(unary, pairs)
    assert value == _brute(unary, pairs)
    # the returned choice attains it
    assert value == sum(int(u[i]) for u, i in zip(unary, choice)) + sum(
        int(m[choice[a], choice[b]]) for (a, b), m in pairs.items())


def test_wide_graph_raises_too_wide():
    n, d = 6, 12  # a clique: every elimination has all the others as neighbours
    rng = np.random.default_rng(0)
    unary = [rng.integers(0, 100, d) for _ in range(n)]
    pairs = {(a, b): rng.integers(0, 100, (d, d)) for a, b in itertools.combinations(range(n), 2)}
    with pytest.raises(TooWide):
        eliminate(unary, pairs, max_table=1000)
    assert eliminate(unary, pairs)[0] == _brute(unary, pairs)


def test_ties_go_to_least_memory():
    # two groups, both choices of group 0 cost the same; the second needs less memory
    p = Problem(cost=[[5, 5], [1, 2]], mem=[[100, 10], [0, 0]],
                edges=[Edge(0, 1, (0, 1), (0, 1), {(0, 1): 7, (1, 1): 7})])
    assert solve_unconstrained(p) == [1, 0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=4),
                min_size=1, max_size=4))
def test_min_memory_is_exact(groups):
    mem = [[m for m, _ in g] for g in groups]
    tr = [[t for _, t in g] for g in groups]
    p = Problem(cost=[[0] * len(g) for g in groups], mem=mem, transient=tr)
    want = min(p.evaluate(list(c))[1] for c in itertools.product(*(range(len(g)) for g in groups)))
    assert min_memory(p) == want


def test_budget_binding_goes_to_cpsat():
    # the cheapest choice does not fit: elimination's optimum is rejected, CP-SAT solves
    p = Problem(cost=[[1, 9]], mem=[[100, 10]], budget=50)
    sol = solve(p)
    assert sol.choice == [1] and sol.method == "cpsat"
    assert solve(Problem(cost=[[1, 9]], mem=[[100, 10]], budget=500)).method == "elimination"


def test_row_classes_exact_even_when_the_projection_collides(monkeypatch):
    import stpc.planner.elimination as E

    m = np.array([[1, 2], [3, 4], [1, 2], [5, 6], [3, 4]], dtype=np.int64)
    for proj in (E._projection, lambda n: np.zeros(n, dtype=np.uint64)):  # real, then all-colliding
        monkeypatch.setattr(E, "_projection", proj)
        rows, inv = E._row_classes(m)
        assert rows.tolist() == [[1, 2], [3, 4], [5, 6]]
        assert inv.tolist() == [0, 1, 0, 2, 1]


@st.composite
def three_neighbour_steps(draw):
    """Group 0 with neighbours 1, 2, 3: binary factors, optionally one ternary (0, 1, 2)."""
    dom = [draw(st.integers(1, 6)) for _ in range(4)]
    hi = draw(st.sampled_from([2, 1000]))

    def table(*shape):
        return np.array(draw(st.lists(st.integers(0, hi), min_size=int(np.prod(shape)),
                                      max_size=int(np.prod(shape))))).reshape(shape).astype(np.int64)
    fs = [((0,), table(dom[0]))] + [((0, v), table(dom[0], dom[v])) for v in (1, 2, 3)]
    if draw(st.booleans()):
        fs.append(((0, 1, 2), table(dom[0], dom[1], dom[2])))
    return dom, fs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(three_neighbour_steps())
def test_both_three_neighbour_plans_equal_the_dense_scan(step):
    from stpc.planner.elimination import _dense, _fixing_plan, _split_plan

    dom, fs = step
    want = _dense(0, fs, (1, 2, 3), dom, 10**6)
    plans = [p for p in (_split_plan(0, fs, (1, 2, 3), dom), _fixing_plan(0, fs, (1, 2, 3), dom)) if p]
    assert plans  # with at most one ternary factor, some plan applies
    for estimate, compute in plans:
        assert estimate > 0
        np.testing.assert_array_equal(compute(), want)


def test_min_plus_in_row_tiles_equals_the_broadcast():
    from stpc.planner.elimination import _BLOCK, _min_plus

    rng = np.random.default_rng(1)
    x = rng.integers(0, 1 << 40, (3 * _BLOCK // (7 * 11) + 5, 7))  # several row tiles
    y = rng.integers(0, 1 << 40, (11, 7)).T                          # a transposed (strided) view
    np.testing.assert_array_equal(_min_plus(x, y), (x[:, :, None] + y[None]).min(axis=1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(factor_graphs(), st.randoms(use_true_random=False))
def test_elimination_exact_whichever_tied_step_goes_first(fg, rnd):
    """A three-neighbour step may be swapped for another of the same size whose tables
    look cheaper, and the greedy order resumes from there: any such swap stays exact.
    Random estimates make the swaps happen in random places."""
    import stpc.planner.elimination as E

    unary, pairs = fg
    real = E._three_plan

    def shuffled(x, fs, others, dom):
        plan = real(x, fs, others, dom)
        return plan and (rnd.randint(1, 10), plan[1])

    E._three_plan = shuffled
    try:
        value, choice = eliminate(unary, pairs)
    finally:
        E._three_plan = real
    assert value == _brute(unary, pairs)
    assert value == sum(int(u[i]) for u, i in zip(unary, choice)) + sum(
        int(m[choice[a], choice[b]]) for (a, b), m in pairs.items())


@st.composite
def class_table_graphs(draw):
    """Pairs given as lists of class tables (the solver's form), some as plain matrices."""
    n = draw(st.integers(1, 6))
    dom = [draw(st.integers(1, 6)) for _ in range(n)]
    hi = draw(st.sampled_from([3, 1000]))
    unary = [np.array([draw(st.integers(0, hi)) for _ in range(d)]) for d in dom]
    pairs = {}
    for a, b in itertools.combinations(range(n), 2):
        if not draw(st.booleans()):
            continue
        if draw(st.booleans()):
            pairs[(a, b)] = np.array([[draw(st.integers(0, hi)) for _ in range(dom[b])] for _ in range(dom[a])])
            continue
        tables = []
        for _ in range(draw(st.integers(1, 3))):
            pa, pb = draw(st.integers(1, dom[a])), draw(st.integers(1, dom[b]))
            ca = np.array([draw(st.integers(0, pa - 1)) for _ in range(dom[a])])
            cb = np.array([draw(st.integers(0, pb - 1)) for _ in range(dom[b])])
            t = np.array([[draw(st.integers(0, hi)) for _ in range(pb)] for _ in range(pa)])
            tables.append((ca, cb, t))
        pairs[(a, b)] = tables
    return unary, pairs


def _expanded(pairs):
    return {ab: m if isinstance(m, np.ndarray) else sum(t[ca][:, cb] for ca, cb, t in m)
            for ab, m in pairs.items()}


@pytest.mark.parametrize("dense_step", [0, None])
@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fg=class_table_graphs())
def test_class_tables_equal_brute_force(fg, dense_step, monkeypatch):  # (the patch is the same every input)
    """Pair costs as class tables (several per pair, joint classes) eliminate exactly;
    with dense_step 0 every two-neighbour step takes the class path, however small."""
    import stpc.planner.elimination as E

    if dense_step is not None:
        monkeypatch.setattr(E, "_DENSE_STEP", dense_step)
    unary, pairs = fg
    dense = _expanded(pairs)
    value, choice = eliminate(unary, pairs)
    assert value == _brute(unary, dense)
    assert value == sum(int(u[i]) for u, i in zip(unary, choice)) + sum(
        int(m[choice[a], choice[b]]) for (a, b), m in dense.items())
    assert choice == eliminate(unary, dense)[1]  # the same optimum as from the matrices


@st.composite
def two_phase_problems(draw):
    """Tiny problems with both memory phases: the end of forward (mem + max transient) and
    the optimizer step (step_mem + max step_transient), random costs, a budget or none."""
    n = draw(st.integers(1, 4))
    dom = [draw(st.integers(1, 4)) for _ in range(n)]

    def rows(hi):
        return [[draw(st.integers(0, hi)) for _ in range(d)] for d in dom]

    budget = draw(st.one_of(st.none(), st.integers(0, 250)))
    return Problem(cost=rows(100), mem=rows(50), transient=rows(50), step_mem=rows(60), step_transient=rows(40),
                   budget=budget)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_phase_problems())
def test_two_memory_phases_min_memory_and_solve_equal_brute_force(p):
    from _oracles import brute_force

    assignments = [list(c) for c in itertools.product(*(range(len(g)) for g in p.cost))]
    peaks = [p.evaluate(c)[1] for c in assignments]
    # the peak is the larger phase, each phase its sum plus its largest transient
    for c, peak in zip(assignments, peaks):
        fwd = sum(p.mem[g][k] for g, k in enumerate(c)) + max(p.transient[g][k] for g, k in enumerate(c))
        step = sum(p.step_mem[g][k] for g, k in enumerate(c)) + max(p.step_transient[g][k] for g, k in enumerate(c))
        assert peak == max(fwd, step)
    assert min_memory(p) == min(peaks)
    if p.budget is not None:
        assert fits_memory(p) == (min(peaks) <= p.budget)
    want = brute_force(p)
    if want is None:
        with pytest.raises(ValueError, match="smallest feasible budget") as e:
            solve(p)
        assert e.value.min_budget == min(peaks)
        return
    sol = solve(p)
    assert sol.objective_ns == want[0]
    assert sol.peak_bytes == p.evaluate(sol.choice)[1] <= (p.budget if p.budget is not None else sol.peak_bytes)


def test_the_optimizer_step_phase_can_bind_alone():
    # choice 0: little saved at the end of forward but a big optimizer step; choice 1 the reverse
    p = Problem(cost=[[1, 5]], mem=[[10, 60]], step_mem=[[100, 60]], budget=80)
    assert p.phase_peaks([0]) == (10, 0, 0, 100) and p.evaluate([0]) == (1, 100)
    sol = solve(p)
    assert sol.choice == [1] and sol.peak_bytes == 60
    # without the step phase, choice 0 fits and wins
    assert solve(Problem(cost=[[1, 5]], mem=[[10, 60]], budget=80)).choice == [0]


def test_the_backward_phase_binds_through_a_memory_edge():
    # two groups; the pair (0, 0) holds 50 more bytes in the last layer's backward (a weight
    # stored sharded and read whole, gathered again), every other pair nothing
    mem_edge = Edge(0, 1, (0, 1), (0, 1), {(0, 0): 50})
    p = Problem(cost=[[1, 5], [1, 5]], mem=[[10, 10], [10, 10]], bwd_mem=[[5, 0], [5, 0]], mem_edges=[mem_edge])
    assert p.phase_peaks([0, 0]) == (20, 0, 80, 0) and p.phase_peaks([1, 0]) == (20, 0, 25, 0)
    assert solve(p).choice == [0, 0]  # no budget: the cheapest
    p.budget = 79
    sol = solve(p)  # the end of forward fits either way; the backward phase rules (0, 0) out
    assert sol.choice in ([0, 1], [1, 0]) and sol.objective_ns == 6 and sol.peak_bytes == 25
    assert min_memory(p) == 20
    p.budget = 19
    with pytest.raises(InfeasibleBudget) as err:
        solve(p)
    assert err.value.min_budget == 20


def _backward_edge_problem(budget):
    """The problem above: the end of forward holds 20 bytes either way, the backward phase 80
    at the pair (0, 0), 25 at (0, 1) and (1, 0), 20 at (1, 1)."""
    mem_edge = Edge(0, 1, (0, 1), (0, 1), {(0, 0): 50})
    return Problem(cost=[[1, 5], [1, 5]], mem=[[10, 10], [10, 10]], bwd_mem=[[5, 0], [5, 0]], mem_edges=[mem_edge],
                   budget=budget)


def test_a_budget_bound_solve_asks_only_whether_anything_fits(monkeypatch):
    # The least peak (a minimisation CP-SAT may not prove in time on a large model:
    # llama2-70b on 32 V100s) is needed only for the error of a budget nothing fits
    def unproven(p, time_limit_s):
        raise AssertionError("the least peak was asked for")
    monkeypatch.setattr(solver, "_least_memory_choice", unproven)
    p = _backward_edge_problem(79)
    for method in ("auto", "cpsat"):
        sol = solve(p, method=method)
        assert sol.choice in ([0, 1], [1, 0]) and sol.peak_bytes == 25
    assert fits_memory(p) and fits_memory(_backward_edge_problem(20)) and not fits_memory(_backward_edge_problem(19))


def _edge_bound_problem(budget):
    """A backward phase whose memory edge is never 0: the cheap per-phase bound (which
    leaves the edges out) says 20 bytes, the least peak is 60 (at (1, 1))."""
    mem_edge = Edge(0, 1, (0, 1), (0, 1), {(0, 0): 50, (0, 1): 40, (1, 0): 40, (1, 1): 40})
    return Problem(cost=[[1, 5], [1, 5]], mem=[[10, 10], [10, 10]], bwd_mem=[[5, 0], [5, 0]], mem_edges=[mem_edge],
                   budget=budget)


def test_an_unproven_least_peak_is_reported_as_the_range_cp_sat_reached(monkeypatch):
    p = _edge_bound_problem(30)
    assert min_memory_bound(p) == 20 and min_memory(p) == 60
    with pytest.raises(InfeasibleBudget) as err:
        solve(p)
    assert (err.value.min_budget, err.value.lower) == (60, 60)   # proven: one figure
    real = solver._least_memory_choice
    weaker = {"by": 25}

    def out_of_time(p, time_limit_s):   # a plan found, its optimality not proven: a weaker bound
        choice, bound = real(p, time_limit_s)
        return choice, bound - weaker["by"]
    monkeypatch.setattr(solver, "_least_memory_choice", out_of_time)
    assert least_memory(p) == (35, 60)
    with pytest.raises(SolverTimeout, match="between 35 and 60 bytes"):
        min_memory(p)
    with pytest.raises(InfeasibleBudget, match="between 0.000 and 0.000 GiB [(]35 to 60 bytes") as err:
        solve(p)
    assert (err.value.min_budget, err.value.lower) == (60, 35)
    again = pickle.loads(pickle.dumps(err.value))   # (rank 0's error, as the other ranks get it)
    assert (again.min_budget, again.lower, str(again)) == (60, 35, str(err.value))
    # a bound weaker than what is known besides: the budget it failed (30) and the cheap bound
    weaker["by"] = 45
    assert least_memory(p) == (15, 60)
    with pytest.raises(InfeasibleBudget) as err:
        solve(p)
    assert (err.value.min_budget, err.value.lower) == (60, 31)
    proven = InfeasibleBudget(19, 20)
    assert proven.lower == 20 and "is 0.000 GiB (20 bytes)" in str(proven)


def test_the_backward_phase_holds_its_own_working_sets_not_the_forwards():
    # group 0 is the loss (a large forward working set, none in the last layer's backward),
    # group 1 a last-layer op whose choice 0 has a large working set there
    p = Problem(cost=[[1], [1, 5]], mem=[[10], [10, 10]], transient=[[60], [5, 5]], bwd_mem=[[0], [20, 20]],
                bwd_transient=[[0], [50, 5]])
    assert p.phase_peaks([0, 0]) == (80, 0, 20 + 50 + 20, 0) and p.phase_peaks([0, 1]) == (80, 0, 20 + 5 + 20, 0)
    without = dataclasses.replace(p, bwd_transient=None)  # the forward's largest working set instead
    assert without.phase_peaks([0, 0])[2] == 20 + 60 + 20
    p.budget = 85
    sol = solve(p)  # the backward phase rules choice 0 out, though both fit the end of forward
    assert sol.choice == [0, 1] and sol.peak_bytes == 80
    assert min_memory(p) == 80 and min_memory_bound(p) <= 80
    p.budget = 79
    with pytest.raises(InfeasibleBudget):
        solve(p)


def test_the_head_phase_frees_what_the_head_saved_and_binds_through_its_reduction_edge():
    # group 0 a parameter (choice 0: stored split, 1: replicated), group 1 the head's matmul
    # (choice 0 reads it whole, 1 reads it split); the head phase holds the end of forward,
    # less 30 bytes the head saved (head_mem on group 1), plus the gradient as computed, plus
    # (pair (0, 0): ZeRO's reduce-scatter buffers) 60 more
    red = Edge(0, 1, (0, 1), (0, 1), {(0, 0): 60})
    p = Problem(cost=[[1, 5], [1, 5]], mem=[[10, 40], [50, 50]], head_mem=[[0, 0], [-30 + 40, -30 + 10]],
                head_edges=[red])
    assert p.has_head_phase and not p.has_bwd_phase
    assert p.phase_peaks([0, 0]) == (60, 60 + 10 + 60, 0, 0)
    assert p.phase_peaks([1, 1]) == (90, 90 - 20, 0, 0)
    assert solve(p).choice == [0, 0]          # no budget: the cheapest
    p.budget = 100
    sol = solve(p)                            # the head phase rules (0, 0) out; the end of forward fits it
    assert sol.choice in ([0, 1], [1, 0]) and sol.objective_ns == 6 and sol.peak_bytes == p.evaluate(sol.choice)[1]
    assert sol.peak_bytes <= 100
    assert min_memory(p) == min(max(p.phase_peaks([u, v])) for u in (0, 1) for v in (0, 1))
    assert min_memory_bound(p) <= min_memory(p)
    p.budget = min_memory(p) - 1
    with pytest.raises(InfeasibleBudget) as err:
        solve(p)
    assert err.value.min_budget == min_memory(p)


def test_a_saved_tensor_edge_lowers_every_phase_that_holds_activations():
    # group 0 produces a tensor of 40 bytes (in mem) that group 1 alone saves; group 1's
    # choice 1 keeps its own blocks instead (5 bytes, in its mem): the pair (any, 1) holds -40
    saved = Edge(0, 1, (0,), (0, 1), {(0, 1): -40})
    p = Problem(cost=[[1], [1, 3]], mem=[[40], [0, 5]], transient=[[0], [10, 10]], bwd_mem=[[0], [7, 7]],
                head_mem=[[0], [2, 2]], step_mem=[[20], [0, 0]], saved_edges=[saved])
    assert p.phase_peaks([0, 0]) == (50, 42, 57, 20)
    assert p.phase_peaks([0, 1]) == (15, 7, 22, 20)   # (the optimizer step holds no activations)
    p.budget = 30
    sol = solve(p)
    assert sol.choice == [0, 1] and sol.peak_bytes == 22
    assert min_memory(p) == 22 and min_memory_bound(p) <= 22
    p.budget = 21
    with pytest.raises(InfeasibleBudget) as err:
        solve(p)
    assert err.value.min_budget == 22
