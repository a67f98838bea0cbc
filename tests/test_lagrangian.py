"""The Lagrangian lower bound (``stpc.planner.lagrangian``): never above the budgeted
optimum (exhaustive enumeration on random problems), each relaxed phase never above its
peak, and strong enough to prove a cap the memory-blind bound cannot."""
import itertools
import os
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from _oracles import brute_force  # noqa: E402
from test_solver import problems  # noqa: E402
from stpc.planner import lagrangian  # noqa: E402
from stpc.planner.solver import Problem, memory_blind_optimum  # noqa: E402

PHASE_INDEX = {"end of forward": 0, "head's gradients": 1, "last layer's backward": 2, "optimizer step": 3}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems(with_budget=True), data=st.data())
def test_each_relaxed_phase_is_at_most_its_peak(p, data):
    at = [data.draw(st.integers(0, len(c) - 1)) for c in p.cost]  # (whose largest working set stands in)
    for ph in lagrangian.phases(p, at):
        for choice in itertools.product(*(range(len(c)) for c in p.cost)):
            assert ph.bytes_at(list(choice)) <= p.phase_peaks(list(choice))[PHASE_INDEX[ph.name.split(" (")[0]]]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems(with_budget=True), lam=st.floats(0, 50))
def test_the_bound_is_never_above_the_budgeted_optimum(p, lam):
    best = brute_force(p)
    if best is None:  # (no assignment fits: every bound is valid)
        return
    assert lagrangian.lower_bound(p) <= best[0]
    assert lagrangian.lower_bound(p, at=best[1]) <= best[0]
    for ph in lagrangian.phases(p, best[1]):
        value, _ = lagrangian.relaxed_minimum(p, ph, lam)
        assert value <= best[0]
    # With a cap below the optimum it may stop early; it never claims more than the truth.
    assert lagrangian.lower_bound(p, cap=best[0] - 1) <= best[0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems(with_budget=True), data=st.data())
def test_the_plan_in_hand_fits_and_is_optimal_where_it_says(p, data):
    at = data.draw(st.none() | st.just([0] * len(p.cost)))
    r = lagrangian.relax(p, at=at)
    best = brute_force(p)
    if r.choice is not None:
        obj, peak = p.evaluate(r.choice)
        assert peak <= p.budget and (obj, peak) == (r.objective_ns, r.peak_bytes)
        assert best is not None and obj >= best[0]
        if r.bound is not None:
            assert r.bound < obj   # (never a proof of its own plan: see Relaxation)
    if best is not None and r.bound is not None:
        assert r.bound <= best[0]


def two_knobs(budget: int) -> Problem:
    """Two groups, each fast and big (1000 ns, 60 B) or slow and small (3000 ns, 10 B)."""
    return Problem(cost=[[1000, 3000], [1000, 3000]], mem=[[60, 10], [60, 10]], budget=budget)


def test_it_proves_a_cap_the_memory_blind_bound_cannot():
    p = two_knobs(80)  # the optimum: one of each, 4000 ns in 70 B
    assert brute_force(p)[0] == 4000
    # (on the way its minimisers include both slow, 6000 ns in 20 B: a plan in hand, not
    # the optimum, and not proven anything by the bound)
    held = lagrangian.relax(p)
    assert (held.choice, held.objective_ns, held.peak_bytes) == ([1, 1], 6000, 20)
    assert held.bound < held.objective_ns
    assert memory_blind_optimum(p)[1] == 2000  # both fast, 120 B: proves no cap above 2000
    # The relaxation's best: saving the 40 B over the budget at 40 ns a byte, 3600 ns.
    assert 3590 <= lagrangian.lower_bound(p) <= 3600
    assert lagrangian.lower_bound(p, cap=3500) > 3500
    # A cap the relaxation cannot beat: it stops once its bracket says so, below the cap.
    assert lagrangian.lower_bound(p, cap=3700) <= 3600


def test_an_infeasible_budget_gives_a_bound_above_any_cap():
    p = two_knobs(15)  # even both small take 20 B
    assert brute_force(p) is None
    assert lagrangian.lower_bound(p, cap=10**9) > 10**9


def test_no_budget_no_bound():
    p = two_knobs(80)
    p.budget = None
    assert lagrangian.lower_bound(p) is None


def test_the_largest_working_set_at_the_blind_optimum_stands_in_for_the_max():
    """Group 0: fast with a 50 B working set, or slow with 10 B; the budget holds 30 B of
    working set. The max's constant (the largest of the groups' least, 10 B) never binds; the
    working set of the group largest at the memory-blind optimum (group 0, 50 B) does."""
    p = Problem(cost=[[1000, 3000], [0]], transient=[[50, 10], [5]], budget=30)
    assert brute_force(p)[0] == 3000
    blind = memory_blind_optimum(p)[0]
    assert blind == [0, 0]
    assert lagrangian.lower_bound(p, cap=1500) <= 1500             # the constant alone: ~1000
    assert lagrangian.lower_bound(p, cap=1500, at=blind) > 1500    # at lambda 50 ns a byte: 2000
    assert lagrangian.lower_bound(p, at=blind) <= 3000
