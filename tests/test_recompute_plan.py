"""Activation recomputation as a plan choice: what the planner charges for it, and when the
search takes it (``Hints.recompute``; the runtime side is ``passes.recompute``)."""
import dataclasses

import pytest
import torch
from _graphs import traced_and_plan

import stpc
from stpc import models
from stpc.passes import Recompute, cleanup, insert_collectives, recompute, ring_decompose, shard_params
from stpc.planner import Hints, search
from stpc.planner.analysis import analyse, layer_of
from stpc.planner.baselines import describe_layout
from stpc.planner.cache import plan_key
from stpc.planner.hints import fsdp_tp, megatron
from stpc.planner.search import recompute_counts
from stpc.planner.solver import InfeasibleBudget
from stpc.planner.summary import breakdown


def _traced(name="gpt-tiny", batch=8, seq=64, **overrides):
    with torch.device("meta"):
        m = models.build(name, **overrides)
    return stpc.trace(m, models.example_inputs(name, batch, seq))


@pytest.fixture(scope="module")
def gpt():
    return _traced()


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
@pytest.mark.parametrize("family", ["own", "megatron", "fsdp-tp"])
def test_recompute_trades_time_for_memory_in_every_family(gpt, mesh, family):
    base = {"own": Hints, "megatron": lambda: megatron(mesh),
            "fsdp-tp": lambda: fsdp_tp(mesh, 0, 1 if len(mesh) > 1 else None)}[family]()
    plain = search(gpt, mesh, hints=dataclasses.replace(base, recompute="none"))
    rec = search(gpt, mesh, hints=dataclasses.replace(base, recompute="full"))
    assert rec.stats["recompute"] == "full" and "recompute" not in plain.stats
    # what forward keeps for backward shrinks (each layer's inputs, as its ops read them, and
    # the head's, instead of everything its ops save) and the peak with it; the peak less so
    # where a layer's ops read its input gathered, a copy its checkpoint keeps too
    # (``Builder._kept_entry_edges``: gpt-tiny's ZeRO-3 plan on 4 gathers each layer's input
    # for its first norm, a near-tie of time on this tiny model)
    assert breakdown(rec)["activation_bytes"] < 0.75 * breakdown(plain)["activation_bytes"]
    assert rec.peak_memory_bytes < plain.peak_memory_bytes
    assert rec.modelled_step_time_s > plain.modelled_step_time_s


def test_kept_tensors_are_the_layers_inputs_and_the_heads(gpt):
    facts = analyse(gpt)
    kept = {it.node for it in facts.kept_saved}
    # every kept tensor is saved outside the layers or enters a layer from outside it
    for t in kept:
        readers = {layer_of(u) for u in t.users}
        assert layer_of(t) is None or readers - {layer_of(t)}, t.name
    # each layer's input is kept: the embedding's sum for layer 0, layer 0's residual output for layer 1
    into = {layer_of(u) for t in kept for u in t.users if layer_of(t) != layer_of(u)} - {None}
    assert into == {0, 1}
    # what the last layer's replay saves again is the last layer's own
    assert facts.replay_saved and all(layer_of(it.node) in (0, None) or it.count > 1 for it in facts.replay_saved)
    assert sum(facts.kept_saved.values()) < sum(facts.saved_uses.values()) / 3


@pytest.mark.slow  # (two minutes of CP-SAT on 2 cores)
def test_the_search_recomputes_only_where_the_budget_binds(gpt):
    free = search(gpt, 4)
    assert "recompute" not in free.stats and not free.stats["layout"].get("recompute")
    # every point without recompute was built once: none was tried with it
    assert not [t for t in free.stats["mesh_shapes_tried"] if t["layout"].get("recompute")]
    least = {}
    for r in ("none", "full"):  # the least memory any plan needs, without and with recompute
        with pytest.raises(InfeasibleBudget) as e:
            search(gpt, 4, budget_bytes=1, hints=Hints(recompute=r))
        least[r] = e.value.min_budget
    assert least["full"] < 0.8 * least["none"]
    budget = (least["full"] + least["none"]) / 2
    with pytest.raises(InfeasibleBudget):
        search(gpt, 4, budget_bytes=budget, hints=Hints(recompute="none"))
    tight = search(gpt, 4, budget_bytes=budget)
    assert tight.stats["recompute"] == "full" and tight.stats["layout"]["recompute"] == "full"
    assert tight.peak_memory_bytes <= budget
    assert "layers recomputed in backward" in describe_layout(tight.stats["layout"])


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
@pytest.mark.parametrize("family", ["own", "megatron", "fsdp-tp"])
def test_selective_lies_between_none_and_full(model, mesh, family):
    """Selective recomputation replays a subset of what full recomputation replays and keeps a
    subset of what no recomputation keeps: every family's plan is as slow as or slower than
    without it and faster than with full recomputation, and keeps less than without it and
    more than with full."""
    tg = _traced(model)
    base = {"own": Hints, "megatron": lambda: megatron(mesh),
            "fsdp-tp": lambda: fsdp_tp(mesh, 0, 1 if len(mesh) > 1 else None)}[family]()
    plans = {r: search(tg, mesh, hints=dataclasses.replace(base, recompute=r)) for r in ("none", "selective", "full")}
    time = {r: p.modelled_step_time_s for r, p in plans.items()}
    act = {r: breakdown(p)["activation_bytes"] for r, p in plans.items()}
    assert time["none"] < time["selective"] < time["full"], time
    assert act["full"] < act["selective"] < act["none"], act
    sel = plans["selective"]
    assert sel.stats["recompute"] == "selective" and "layers recomputed in backward but for" in describe_layout(
        sel.stats["layout"] | {"recompute": "selective"})
    # what it keeps: plain matmuls and attentions inside the layers, each an output backward keeps anyway
    facts = analyse(tg)
    kept = {n for n in tg.graph.nodes if n.name in sel.stats["recompute_kept"]}
    assert kept and all(layer_of(n) is not None and facts.node_item[n] in facts.saved_uses for n in kept)
    assert all(sel.nodes[n.name].kind in ("spatial", "replicate-fallback") for n in kept)


def test_the_search_tries_every_rung_where_the_budget_binds():
    """Where no recomputation does not fit, every rung of the ladder (the first k layers, each
    level) is a candidate, built lazily. llama-tiny on 4, the budget just above selective
    recomputation's memory-blind peak: recomputing only the first of the two layers in full
    is faster than recomputing both selectively (the climb that stopped at the first rung
    whose memory-blind optimum fits never built it); under selective's least budget, full."""
    llama = _traced("llama-tiny")
    free = {r: search(llama, 4, hints=Hints(recompute=r)) for r in ("none", "selective")}
    assert free["selective"].peak_memory_bytes < free["none"].peak_memory_bytes
    budget = free["selective"].peak_memory_bytes * 1.001
    mid = search(llama, 4, budget_bytes=budget)
    assert mid.peak_memory_bytes <= budget
    half = search(llama, 4, budget_bytes=budget, hints=Hints(recompute="full", recompute_layers=1))
    assert (mid.stats["recompute"], mid.stats["recompute_layers"]) == ("full", 1)
    assert mid.modelled_step_time_s == pytest.approx(half.modelled_step_time_s)
    assert mid.modelled_step_time_s < free["selective"].modelled_step_time_s
    rungs = {(t["layout"].get("recompute"), t["layout"].get("recompute_layers")) for t in mid.stats["mesh_shapes_tried"]}
    assert {("selective", 1), ("selective", None), ("full", 1), ("full", None)} <= rungs
    least = {}
    for r in ("selective", "full"):
        with pytest.raises(InfeasibleBudget) as e:
            search(llama, 4, budget_bytes=1, hints=Hints(recompute=r))
        least[r] = e.value.min_budget
    assert least["full"] < least["selective"]
    low = search(llama, 4, budget_bytes=(least["full"] + least["selective"]) / 2)
    assert low.stats["recompute"] == "full"
    assert {"selective", "full"} <= {t["layout"].get("recompute") for t in low.stats["mesh_shapes_tried"]}


@pytest.fixture(scope="module")
def gpt4():
    return _traced(n_layers=4)


@pytest.mark.parametrize("level", ["full", "selective"])
@pytest.mark.parametrize("family", ["own", "megatron"])
def test_each_layer_more_recomputed_trades_time_for_memory(gpt4, level, family):
    """``Hints.recompute_layers`` = k recomputes the first k layers: each one more replays
    one more layer's forward (slower) and keeps one layer's saved activations less (smaller);
    k = every layer is the plain level (the same plan)."""
    base = Hints() if family == "own" else megatron((4,))
    plans = [search(gpt4, (4,), hints=dataclasses.replace(base, recompute="none"))]
    plans += [search(gpt4, (4,), hints=dataclasses.replace(base, recompute=level, recompute_layers=k))
              for k in (1, 2, 3, 4)]
    times = [p.modelled_step_time_s for p in plans]
    peaks = [p.peak_memory_bytes for p in plans]
    acts = [breakdown(p)["activation_bytes"] for p in plans]
    assert times == sorted(times) and len(set(times)) == 5, times
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 5, peaks
    assert acts == sorted(acts, reverse=True), acts
    assert [p.stats.get("recompute_layers") for p in plans] == [None, 1, 2, 3, None]
    every = search(gpt4, (4,), hints=dataclasses.replace(base, recompute=level))
    assert every.hash() == plans[-1].hash()
    assert f"the first 2 layers recomputed in backward" in describe_layout({"mesh": "4", "recompute": level,
                                                                           "recompute_layers": 2})


def test_a_rung_is_pruned_before_its_edges_by_its_groups_least_costs(gpt4):
    """gpt-tiny with 4 layers on 4 V100s, the budget just above selective recomputation's
    memory-blind peak: most rungs (their replay's time is in their groups' costs) cannot beat
    the plan by their groups' least costs alone, and are pruned with no edge built; each
    such bound lies above the plan's time, and the plan is proven optimal."""
    free = search(gpt4, 4, "primepar-v100", hints=Hints(recompute="selective"))
    budget = free.peak_memory_bytes * 1.001
    plan = search(gpt4, 4, "primepar-v100", budget_bytes=budget)
    assert plan.peak_memory_bytes <= budget and plan.stats["optimal"]
    unbuilt = [t for t in plan.stats["mesh_shapes_tried"] if t.get("edges_built") is False]
    assert len(unbuilt) >= 10, len(unbuilt)
    assert all(t["layout"].get("recompute") and t["pruned"] for t in unbuilt)
    assert all(t["lower_bound_s"] > plan.modelled_step_time_s for t in unbuilt)

def test_the_recomputed_layers_are_tied_apart(gpt4):
    """With the first 2 of 4 layers recomputed, layers 1 and 3 tie to layers 0 and 2 (not
    all three to 0): an item is replayed in all its copies or in none. What forward keeps
    is each recomputed layer's input and everything the other layers' ops save; the last
    layer is not replayed, so its backward holds no replay."""
    every, half = analyse(gpt4), analyse(gpt4, 2)
    assert analyse(gpt4, 2) is half and analyse(gpt4, 4) is every  # (cached; 4 of 4 is every layer)
    assert every.recomputed == {0, 1, 2, 3} and every.recompute_layers is None
    assert half.recomputed == {0, 1} and half.recompute_layers == 2
    assert {layer_of(r) for r in every.tie.values()} == {0}
    assert {(layer_of(n), layer_of(r)) for n, r in half.tie.items()} == {(1, 0), (3, 2)}
    replayed = {layer_of(n) for n, it in half.node_item.items() if it in half.layer_items and n.op != "placeholder"}
    assert replayed == {0, 1}
    assert not half.replay_saved and every.replay_saved
    # the last layer's items (layer 2's copies are the same items) are none of a recomputed layer
    last = {layer_of(n) for n, it in half.node_item.items() if it in half.last_layer}
    assert last == {2, 3}
    # kept: the first two layers' inputs (entering 0 and 1) and all the later layers save
    kept = {it.node for it in half.kept_saved}
    entering = {layer_of(u) for t in kept for u in t.users if layer_of(t) != layer_of(u)} - {None}
    assert {0, 1} <= entering
    later = sum(c for it, c in half.saved_uses.items() if layer_of(it.node) in (2, 3))
    assert later and sum(c for it, c in half.kept_saved.items() if layer_of(it.node) in (2, 3)) == later
    assert sum(every.kept_saved.values()) < sum(half.kept_saved.values()) < sum(half.saved_uses.values())


def test_kept_gathered_weights_of_the_layers_not_recomputed_are_reported(gpt4):
    """ZeRO-2 keeps each whole weight gathered in forward for backward, except in a recomputed
    layer (its replay gathers again): the breakdown's kept weights shrink with each layer
    recomputed, as the planner charges them."""
    base = dataclasses.replace(fsdp_tp((4,), 0, None), keep_gathered=(0,))
    kept = [breakdown(search(gpt4, (4,), hints=dataclasses.replace(base, recompute=r, recompute_layers=k)))[
        "kept_weight_bytes"] for r, k in (("none", None), ("full", 2), ("full", None))]
    assert kept[0] > kept[1] > kept[2], kept


def test_a_sole_savers_count_is_its_own_copies(gpt4):
    """The last recomputed layer's output Item has k copies: k - 1 enter recomputed layers
    (the checkpoints keep them), one enters the first kept layer, whose norm alone saves it.
    The P(2x2) credit of that saver (``Builder._saved_edges``) counts that one copy."""
    half = analyse(gpt4, 2)
    assert all(n <= half.saved_uses[it] for (it, _, _), n in half.sole_saved.items())
    split = [(it, n) for (it, sv, _), n in half.sole_saved.items()
             if sv not in half.layer_items and layer_of(sv.node) is not None and n < half.kept_saved[it]]
    assert split and all(n == 1 for _, n in split), split


def test_the_recompute_ladder():
    assert recompute_counts(4) == [1, 2, 3, None]
    assert recompute_counts(2) == [1, None]
    assert recompute_counts(1) == [None] and recompute_counts(0) == [None]
    assert recompute_counts(6) == [2, 3, 5, None]
    assert recompute_counts(80) == [20, 40, 60, None]


def test_recompute_is_part_of_a_plans_identity(gpt):
    plan = search(gpt, (4,), hints=Hints(recompute="none"))
    twin = dataclasses.replace(plan, stats={**plan.stats, "recompute": "full"})
    assert twin.hash() != plan.hash()
    keys = {plan_key(gpt, (4,), "cpu-local", None, Hints(recompute=r), True)
            for r in (None, "none", "selective", "full")}
    assert len(keys) == 4
    with pytest.raises(ValueError, match="Hints.recompute='some'.: one of None, 'none', 'selective', 'full'"):
        Hints(recompute="some")
    partial = {plan_key(gpt, (4,), "cpu-local", None, Hints(recompute="full", recompute_layers=k), True)
               for k in (None, 1)}
    assert len(partial) == 2
    layers = dataclasses.replace(twin, stats={**twin.stats, "recompute_layers": 1})
    assert layers.hash() != twin.hash()
    for bad in (dict(recompute_layers=1), dict(recompute="none", recompute_layers=1),
                dict(recompute="full", recompute_layers=0), dict(recompute="full", recompute_layers=1.5)):
        with pytest.raises(ValueError, match="Hints.recompute_layers=.*a count of layers >= 1, with recompute="):
            Hints(**bad)


@pytest.mark.parametrize("family,mesh", [("megatron", "4"), ("megatron", "2x2"), ("ag_rs", "2x2"), ("zero", "4"),
                                         ("p2x2", "4")])
def test_a_layers_kept_copies_are_the_reshards_its_span_reads(family, mesh):
    # What the planner charges beyond each layer's entering tensor (``_kept_entry_edges``, at
    # the chosen pairs) is what the lowered program's checkpointed spans read from reshards
    # of activations placed before them (parameters' own collectives aside: held anyway).
    tg, plan = traced_and_plan("gpt-tiny", mesh, f"{family}+recompute", **({"bias": False} if family == "p2x2" else {}))
    gm = shard_params(tg.gm, plan, groups=["g0", "g1"][:len(plan.mesh_shape)])
    gm = recompute(cleanup(ring_decompose(insert_collectives(gm, plan), plan), plan), plan)
    params = set(tg.param_fqns)

    def of_params(n):  # a collective of a parameter (a ZeRO gather, a norm weight's gradient sync)
        return all(a.op == "placeholder" and a.name in params for a in n.all_input_nodes)

    read = 0
    for call in gm.graph.nodes:
        if call.op == "call_module" and isinstance(gm.get_submodule(call.target), Recompute):
            for a in call.all_input_nodes:
                if (a.op == "call_function" and getattr(a.target, "__module__", "").startswith("stpc.runtime")
                        and not of_params(a)):
                    read += a.meta["val"].numel() * a.meta["val"].element_size()
    p, ch = plan.solved.problem, plan.solved.choice
    # (the head's ZeRO-3 weights kept for their backward are held from forward too, and freed
    # by the head's backward: each such saved edge has its negation among the head's edges;
    # parameters' own gathers, left aside as above)
    kept = {(e.u, e.v, tuple(sorted((k, -b) for k, b in e.table.items()))) for e in p.head_edges}
    spans = [e for e in p.saved_edges if (e.u, e.v, tuple(sorted(e.table.items()))) not in kept]
    charged = sum(e.table.get((e.ucls[ch[e.u]], e.vcls[ch[e.v]]), 0) for e in spans)
    assert charged == read
    if family in ("megatron", "p2x2"):  # (these layouts reshard each layer's input for its first norm)
        assert read > 0
    if family == "zero":  # (its embedding reads the tied table whole on each rank's rows, sharing the
        assert read == 0  # head's gather: its output enters the layers as they read it, nothing kept)


def test_the_searchs_recompute_arguments_set_every_point(gpt4):
    """``search(recompute=, recompute_layers=)`` sets the level and count on every point; a
    count of every layer is no count (the plain level), and a count needs a level."""
    two = search(gpt4, (4,), recompute="full", recompute_layers=2)
    assert two.stats["recompute_layers"] == 2 and two.stats["layout"]["recompute_layers"] == 2
    four = search(gpt4, (4,), recompute="full", recompute_layers=4)
    assert "recompute_layers" not in four.stats and "recompute_layers" not in four.stats["layout"]
    assert four.hash() == search(gpt4, (4,), recompute="full").hash()
    # a point's own count stays where the level is given without one
    own = search(gpt4, (4,), hints=Hints(recompute="full", recompute_layers=1), recompute="full")
    assert own.stats["recompute_layers"] == 1
    with pytest.raises(ValueError, match="recompute_layers"):
        search(gpt4, (4,), recompute="none", recompute_layers=1)
