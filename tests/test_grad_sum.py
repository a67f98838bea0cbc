"""grad_sum: a parameter several ops read has its gradient summed once per mesh axis."""
import itertools
import os
import random
import sys

import pytest
import torch

from stpc import models, trace
from stpc.cost_models import CostModel, get_cluster
from stpc.planner import Hints, plan_graph, search
from stpc.planner import grad_sum
from stpc.planner.hints import TOKEN_EMBEDDING, data_parallel

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import run_cases, whole_embedding_hints  # noqa: E402

from stpc.runtime.launch import spawn  # noqa: E402


def _truth(bases, needs, sums):
    """What the runtime pays on one axis: every reader's edge that is not the sum, and the sum
    once, as the earliest reader that needs it pays it (none: no sum)."""
    first = next((j for j, n in enumerate(needs) if n), None)
    return sum(b for b, n in zip(bases, needs) if not n) + (sums[first] if first is not None else 0.0)


@pytest.mark.parametrize("placement", ["R", "S0"])
@pytest.mark.parametrize("readers", [2, 3, 4])
def test_the_least_charge_over_modes_is_the_one_sum(readers, placement):
    """Brute force: for every reader choice (needs the sum, or the gather, or not, what its
    edge costs), the cheapest mode charges exactly what the runtime pays, and no mode less."""
    rng = random.Random(readers)
    mesh = (4,)
    modes = grad_sum.modes((placement,), mesh, readers, gathers=True)
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


def test_modes_on_replicated_axes_and_on_the_one_axis_a_gather_reads_the_parameter_on():
    """An axis of more than one device that the placement replicates gets modes; one it
    splits only where the readers' gathers are one call (``gathers``: every reader reads one
    node) and no other axis splits it (a gather over one of two split axes reads the
    other's output, which differs between readers)."""
    assert grad_sum.modes(("S0", "R"), (2, 2), 3) == [(-1, -1), (-1, 0), (-1, 1)]
    assert grad_sum.modes(("S0", "R"), (2, 2), 2, gathers=True) == [(-1, -1), (-1, 0), (0, -1), (0, 0)]
    assert grad_sum.modes(("S0", "S1"), (2, 2), 2, gathers=True) == [(-1, -1)]
    assert grad_sum.modes(("S0", "S1"), (1, 4), 2, gathers=True) == [(-1, -1), (-1, 0)]  # (axis 0: one device)
    assert grad_sum.modes(("R", "R"), (1, 4), 2) == [(-1, -1), (-1, 0)]
    assert grad_sum.modes(("R", "R"), (2, 2), 2) == [(-1, -1), (-1, 0), (0, -1), (0, 0)]
    assert grad_sum.needs_sum("S1", "R", True, True) and grad_sum.needs_sum("R", "R", True, True)
    assert not grad_sum.needs_sum("S1", "R", False, True)  # (its gather slices the gradient: another call)
    assert not grad_sum.needs_sum("S1", "S1", True, True) and not grad_sum.needs_sum("S1", "R", True, False)


def _gpt(tied: bool, **overrides):
    with torch.device("meta"):
        m = models.build("gpt-tiny", bias=False, tied_head=tied, **overrides)
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


def _zero_embedding_hints():
    """ZeRO over mesh axis 0 (every weight stored split there, replicated on the others),
    data parallel on every axis: each linear and the token embedding split their batch and
    read their weight whole, so the tied weight is gathered by both of its readers."""
    return Hints(force=[(r".", lambda s: s.kind == "spatial"),
                        (r"^linear", lambda s: all(t == "S0" for t in s.ins[0])),
                        (TOKEN_EMBEDDING, lambda s: all(t == "S0" for t in s.ins[1]))],
                 param_force=[(r".", lambda p: p[0][0] == "S" and all(t == "R" for t in p[1:]))], temporal=False)


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_a_tied_weight_stored_split_is_gathered_once_behind_the_embedding(mesh):
    """ZeRO: the tied weight stored split over axis 0 and read whole by the batch-split
    embedding and head. At run time their gathers are one (``cleanup``), issued with the
    embedding's and kept for the head's backward (``prefetch_params``), with one
    reduce-scatter: charged on the embedding's edge as an untied embedding's is, nothing on
    the head's (an untied head pays its own gather and reduce-scatter; on 2x2 also its
    gradient's sum over axis 1)."""
    cm = CostModel(get_cluster("cpu-local"), mesh)
    hints = _zero_embedding_hints()
    tied, untied = (plan_graph(_gpt(t), cm, hints=hints) for t in (True, False))
    head = [k for k, v in tied.nodes.items() if v.op == "linear.default"][-1]
    for p in (tied, untied):
        assert p.nodes["embedding"].ins[0] == p.nodes[head].ins[1] == ["R"] * len(mesh)
        assert p.nodes["embedding"].ins[1] == p.nodes[head].ins[0] == ["S0"] * len(mesh)
    # the tied embedding pays the untied one's gather and reduce-scatter, no re-gather (the
    # head reads the shared gather: kept from forward for its backward, as an untied head's
    # gathers are; an untied embedding keeps its indices, not its table), the head nothing
    assert untied.nodes["embedding"].comm_s > 0 and untied.nodes[head].comm_s > 0
    assert tied.nodes["embedding"].comm_s == pytest.approx(untied.nodes["embedding"].comm_s, rel=1e-9)
    assert tied.nodes[head].comm_s == 0.0
    assert tied.modelled_step_time_s < untied.modelled_step_time_s


def test_an_embeddings_table_is_gathered_again_only_if_its_group_keeps_a_weight():
    """ZeRO-3 gathers are made again in backward for the ops that read the weight there: an
    embedding keeps its indices, so its gathered table is charged no re-gather, unless a
    parameter gathered with it before the first layer is kept (the runtime gathers the
    group again as a whole): a norm on the embeddings, BLOOM's ``word_embeddings_layernorm``."""
    from stpc.planner.builder import build_problem

    cm = CostModel(get_cluster("cpu-local"), (4,))
    for embed_norm in (False, True):
        tg = _gpt(False, embed_norm=embed_norm)  # (untied: a tied head keeps the table for backward)
        b, _ = build_problem(tg, cm, None, _zero_embedding_hints())
        emb = next(n for n in b.graph.nodes if n.name == "embedding")
        linear = next(n for n in b.graph.nodes if n.target is torch.ops.aten.linear.default)
        assert b._saves(emb, 0) == embed_norm
        assert b._saves(linear, 1)
        plan = plan_graph(tg, cm, hints=_zero_embedding_hints())
        assert plan.nodes["embedding"].ins[0] == ["R"]
        if not embed_norm:
            without = plan.nodes["embedding"].comm_s
    assert 0 < without < plan.nodes["embedding"].comm_s  # (the re-gather charged with the norm only)


def test_the_tied_weights_readers_share_one_gather_at_run_time():
    """What the charge above stands on, in the lowered program of that plan: the tied weight's
    placeholder feeds one gather, read by the embedding and the head; ``prefetch_params``
    issues it before the embedding and keeps it for the head's backward, in a group of its
    own (the embedding norm's weight, gathered beside it, is not kept with it)."""
    from stpc import runtime
    from stpc.passes import cleanup, insert_collectives, prefetch_params, shard_params

    tg = _gpt(True, embed_norm=True)  # (a norm on the embeddings: its weight gathered beside the table)
    plan = search(tg, (4,), "cpu-local", hints=_zero_embedding_hints())
    gm = cleanup(insert_collectives(shard_params(tg.gm, plan, groups=["g0"]), plan), plan)
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("param") == "lm_head.weight")
    gathers = [u for u in ph.users if u.target is runtime.all_gather]
    assert len(gathers) == 1 and len(ph.users) == 1
    readers = {getattr(u.target, "__name__", "") for u in gathers[0].users}
    assert readers == {"embedding.default", "linear.default"}, readers
    gm = prefetch_params(gm, plan)
    (start,) = [n for n in gm.graph.nodes if n.target is runtime.gather_start and ph in n.args[0]]
    (wait,) = [u for u in start.users if u.target is runtime.gather_wait]
    assert wait.kwargs.get("keep")
    assert list(start.args[0]) == [ph]  # (kept alone: the norm's weight, gathered beside it, is not kept)
    (norm,) = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("param") == "ln_emb.weight"]
    (other,) = [n for n in gm.graph.nodes if n.target is runtime.gather_start and norm in n.args[0]]
    assert not next(u for u in other.users if u.target is runtime.gather_wait).kwargs.get("keep")
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    embedding = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    assert order[start] < order[wait] < order[embedding]


@pytest.mark.multirank
def test_that_plan_trains_as_the_single_device_model_on_two_ranks():
    """The shared gather on real gloo ranks: loss, every gradient and every parameter after
    four AdamW steps match the single-device model (``run_cases``: fp32, rtol 1e-4)."""
    plan = search(_gpt(True), (2,), "cpu-local", hints=_zero_embedding_hints())
    assert plan.nodes["embedding"].ins[0] == ["R"] and plan.nodes["embedding"].ins[1] == ["S0"]
    case = dict(id="zero-tied", model="gpt-tiny", overrides={"bias": False}, plan=plan.to_json(), batch=8, seq=64,
                steps=4, opt="adamw")
    results = spawn(run_cases, 2, [case], timeout_s=300)
    for rank in results:
        (r,) = rank
        assert r["steps"] == 4 and not r.get("missing"), r
        assert r["loss"] <= 1 and r["grad"] <= 1 and r["param"] <= 1, r  # (a NaN fails: nan <= 1 is False)
    assert results[0][0]["losses"] == results[1][0]["losses"]


def _regathered_tables(rank, world, cases):
    """Per case: whether backward gathered the token embedding's table again, on this rank."""
    import stpc
    from stpc.planner import Plan
    from stpc.runtime.param_gather import RegatherSaved

    issued = []
    original = RegatherSaved._issue

    def logging_issue(self, g):
        before = g.pending
        original(self, g)
        if g.pending is not None and before is None:
            issued.extend(s.untyped_storage().data_ptr() for s in g.shards)

    RegatherSaved._issue = logging_issue
    out = []
    try:
        for overrides, plan_json in cases:
            torch.manual_seed(0)
            model = models.build("gpt-tiny", bias=False, **overrides)
            plan = Plan.from_json(plan_json)
            g = torch.Generator().manual_seed(1)
            batch = [torch.randint(0, model.cfg.vocab, (8, 64), generator=g) for _ in range(2)]
            dm = stpc.compile(model, tuple(plan.mesh_shape), tuple(batch), plan=plan)
            issued.clear()
            dm(*batch).backward()
            params = dict(dm.named_parameters())
            table = params["wte.weight"].to_local().untyped_storage().data_ptr()
            layer = params["layers.0.attn.q_proj.weight"].to_local().untyped_storage().data_ptr()
            out.append((table in issued, layer in issued))
    finally:
        RegatherSaved._issue = original
    return out


@pytest.mark.multirank
def test_the_runtime_gathers_a_table_again_as_the_model_charges_it():
    """On 2 gloo ranks, ZeRO-3 with the embedding and head reading whole: backward gathers the
    layers' weights again (``RegatherSaved``), the untied table not (the embedding keeps its
    indices), the tied one not either (kept from forward for the head, which keeps the
    weight), the untied one beside an embedding norm yes (its group keeps the norm's
    weight): what ``_saves`` charges."""
    cases = []
    for tied, norm in ((False, False), (True, False), (False, True)):
        overrides = {"tied_head": tied, "embed_norm": norm}
        plan = search(_gpt(tied, embed_norm=norm), (2,), "cpu-local", hints=_zero_embedding_hints())
        assert plan.nodes["embedding"].ins[0] == ["R"]
        cases.append((overrides, plan.to_json()))
    results = spawn(_regathered_tables, 2, cases, timeout_s=300)
    assert results[0] == results[1] == [(False, True), (False, True), (True, True)]
