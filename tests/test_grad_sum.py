"""grad_sum: a parameter several ops read has its gradient summed once per mesh axis."""
import itertools
import os
import random
import sys

import pytest
import torch

from stpc import models, trace
from stpc.cost_models import CostModel, get_cluster
from stpc.planner import Hints, plan_graph
from stpc.planner import grad_sum
from stpc.planner.hints import data_parallel

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import whole_embedding_hints  # noqa: E402


def _truth(bases, needs, sums):
    """What the runtime pays on one axis: every reader's edge that is not the sum, and the sum
    once, as the earliest reader that needs it pays it (none: no sum)."""
    first = next((j for j, n in enumerate(needs) if n), None)
    return sum(b for b, n in zip(bases, needs) if not n) + (sums[first] if first is not None else 0.0)


@pytest.mark.parametrize("readers", [2, 3, 4])
def test_the_least_charge_over_modes_is_the_one_sum(readers):
    """Brute force: for every reader choice (needs the sum or not, what its edge costs), the
    cheapest mode charges exactly what the runtime pays, and no mode charges less."""
    rng = random.Random(readers)
    (placement,), mesh = ("R",), (4,)
    modes = grad_sum.modes((placement,), mesh, readers)
    assert len(modes) == readers  # PER_USE and each reader but the last as the earliest
    for _ in range(300):
        sums = [rng.uniform(0.0, 1.0) for _ in range(readers)]   # each reader's charge for the sum
        other = [rng.uniform(0.0, 1.0) for _ in range(readers)]  # its edge where it needs no sum
        pen = grad_sum.penalty(1.0, 0.0, 1.0)                    # (every charge at most 1.0)
        for needs in itertools.product([False, True], repeat=readers):
            bases = [s if n else o for s, o, n in zip(sums, other, needs)]
            truth = _truth(bases, needs, sums)
            charged = [sum(grad_sum.charge(b, grad_sum.role(m[0], j), n, pen)
                           for j, (b, n) in enumerate(zip(bases, needs))) for m in modes]
            assert min(charged) == pytest.approx(truth)
            assert all(c >= truth - 1e-12 for c in charged)


def test_only_replicated_axes_of_more_than_one_device_get_modes():
    assert grad_sum.modes(("S0", "R"), (2, 2), 3) == [(-1, -1), (-1, 0), (-1, 1)]
    assert grad_sum.modes(("R", "R"), (1, 4), 2) == [(-1, -1), (-1, 0)]
    assert grad_sum.modes(("R", "R"), (2, 2), 2) == [(-1, -1), (-1, 0), (0, -1), (0, 0)]


def _gpt(tied: bool):
    with torch.device("meta"):
        m = models.build("gpt-tiny", bias=False)
        if not tied:
            m.lm_head.weight = torch.nn.Parameter(torch.empty_like(m.lm_head.weight))
    return trace(m, models.example_inputs(models.get_config("gpt-tiny"), 8, 64))


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_a_tied_weights_gradient_is_summed_once_behind_the_embedding(mesh):
    """Data parallel, gpt-tiny's tied embedding and LM head: both read the weight whole and
    split the batch, so each hands back a partial gradient. The runtime sums them and
    all-reduces once, when backward has passed the embedding: charged on the embedding's
    edge as an untied embedding's is, nothing on the head's (an untied head pays its own)."""
    cm = CostModel(get_cluster("cpu-local"), mesh)
    tied = plan_graph(_gpt(True), cm, hints=data_parallel(mesh))
    untied = plan_graph(_gpt(False), cm, hints=data_parallel(mesh))
    head = [k for k, v in tied.nodes.items() if v.op == "linear.default"][-1]
    for p in (tied, untied):
        assert p.nodes["embedding"].ins[0] == ["R"] * len(mesh) and p.nodes[head].ins[1] == ["R"] * len(mesh)
    assert tied.nodes["embedding"].comm_s == pytest.approx(untied.nodes["embedding"].comm_s, rel=1e-9)
    assert tied.nodes["embedding"].comm_s > 0
    assert untied.nodes[head].comm_s > 0
    assert tied.nodes[head].comm_s == 0.0


def test_a_tied_weight_read_whole_by_the_embedding_pays_the_heads_sum():
    """The embedding reads the weight whole over the whole batch (its gradient complete on
    every rank) and the head splits the batch: the head's partial gradient is all-reduced
    alone, behind the head's backward, as an untied head's is."""
    cm = CostModel(get_cluster("cpu-local"), (4,))
    hints = whole_embedding_hints()
    tied = plan_graph(_gpt(True), cm, hints=hints)
    untied = plan_graph(_gpt(False), cm, hints=hints)
    head = [k for k, v in tied.nodes.items() if v.op == "linear.default"][-1]
    assert tied.nodes["embedding"].ins == [["R"], ["R"]]
    assert tied.nodes["embedding"].comm_s == 0.0
    assert tied.nodes[head].comm_s == pytest.approx(untied.nodes[head].comm_s, rel=1e-9)
    assert tied.nodes[head].comm_s > 0


def test_an_embedding_alternative_that_needs_no_sum_hands_it_to_the_head():
    """The plan's alternatives hold the neighbours as planned but let the weight take its
    best mode: the embedding computed whole on every rank (no partial gradient) is scored
    with the head paying its own sum, as an untied head does, not with a penalty."""
    cm = CostModel(get_cluster("cpu-local"), (4,))
    hints = Hints(force=[(r".", lambda s: s.kind == "spatial"), (r"^linear", lambda s: all(t == "S0" for t in s.ins[0]))],
                  param_force=[(r".", lambda p: all(t == "R" for t in p))], temporal=False)
    tied, untied = (plan_graph(_gpt(t), cm, hints=hints) for t in (True, False))
    head = [k for k, v in untied.nodes.items() if v.op == "linear.default"][-1]
    assert tied.nodes["embedding"].describe() == untied.nodes["embedding"].describe() == "(S0)"
    got, want = dict(tied.alternatives["embedding"]), dict(untied.alternatives["embedding"])
    assert got["(S0)"] == pytest.approx(want["(S0)"], rel=1e-9)  # (its batch split: it pays the sum)
    assert got["(R)"] == pytest.approx(want["(R)"] + untied.nodes[head].comm_s, rel=1e-9)


def test_a_solution_left_in_a_costlier_mode_is_settled_to_the_cheapest():
    """A solve cut short may leave the weight in a mode that charges more than the one sum
    (each reader its own, or a penalty): ``settle_modes`` puts it in its cheapest mode for
    the placement chosen and says what that saves."""
    from stpc.planner.builder import build_problem
    from stpc.planner.solver import solve
    b, problem = build_problem(_gpt(True), CostModel(get_cluster("cpu-local"), (4,)), None, data_parallel((4,)))
    sol = solve(problem)
    g = next(iter(b._sum_modes))
    modes = b._sum_modes[g]
    assert modes[sol.choice[g]] == (0,)  # the embedding, the earliest reader, pays the one sum
    worse_modes = [c for c, m in enumerate(modes) if m != (0,)]
    assert worse_modes  # (PER_USE: each reader its own sum)
    for worse in worse_modes:
        choice = list(sol.choice)
        choice[g] = worse
        settled, saved = b.settle_modes(choice, problem)
        assert settled == sol.choice
        assert saved == problem.evaluate(choice)[0] - sol.objective_ns > 0
