"""Each baseline preset is the best plan of its own space: the search against the space
written out by hand here, every point solved on its own with the same cost model and
budget."""
import json
import subprocess
import sys

import pytest
import torch

from stpc import models, trace
from stpc.cost_models import CostModel, get_cluster
from stpc.planner import HintUnsatisfiable, Hints, InfeasibleBudget, mesh_shapes, plan_graph, search
from stpc.planner.baselines import Layout, describe_layout, layout_hints
from stpc.planner.hints import fsdp_tp, megatron, sequence_parallel_nodes
from stpc.planner.summary import breakdown

CLUSTER = get_cluster("primepar-v100")  # 4 devices a node: which axis crosses nodes matters


def _meta_trace(name, batch=8, seq=64, dtype=torch.float32, **overrides):
    with torch.device("meta"):
        m = models.build(name, **overrides).to(dtype)
    return trace(m, models.example_inputs(models.get_config(name), batch, seq))


def megatron_space(n):
    """Megatron on n devices, by hand: (mesh, DP axis, TP axis, ZeRO-1, layout record)."""
    out = []
    for dp in range(1, n + 1):
        if n % dp:
            continue
        tp = n // dp
        for zero in ([True, False] if dp > 1 else [False]):
            rec = {"dp": dp, "tp": tp, "zero": int(zero)}
            if dp == 1:
                out.append(((tp,), None, 0, zero, {**rec, "order": "-"}))
            elif tp == 1:
                out.append(((dp,), 0, None, zero, {**rec, "order": "-"}))
            else:
                out.append(((dp, tp), 0, 1, zero, {**rec, "order": "dp-outer"}))   # TP on the inner axis
                out.append(((tp, dp), 1, 0, zero, {**rec, "order": "tp-outer"}))   # DP on the inner axis
    return out


def fsdp_space(n):
    """FSDP (ZeRO-3) over DP >= 2 with TP+SP on the other axis, by hand."""
    out = []
    for dp in range(2, n + 1):
        if n % dp:
            continue
        tp = n // dp
        rec = {"dp": dp, "tp": tp, "zero": 3}
        if tp == 1:
            out.append(((dp,), 0, None, {**rec, "order": "-"}))
        else:
            out.append(((dp, tp), 0, 1, {**rec, "order": "dp-outer"}))
            out.append(((tp, dp), 1, 0, {**rec, "order": "tp-outer"}))
    return out


def _solve_each(tg, points, budget, layout):
    """(modelled ns, peak, layout record) of every point that runs and fits."""
    got = []
    for mesh, hints, rec in points:
        try:
            plan = plan_graph(tg, CostModel(CLUSTER, mesh), budget, hints, layout)
        except (HintUnsatisfiable, InfeasibleBudget):
            continue
        got.append((round(plan.modelled_step_time_s * 1e9), plan.peak_memory_bytes, rec))
    return got


def _check_best(tg, preset, points, n, budget=None, layout="fp32-adam"):
    each = _solve_each(tg, points, budget, layout)
    assert len(each) >= 2
    best = min(t for t, _, _ in each)
    plan = search(tg, n, CLUSTER, budget_bytes=budget, hints=preset, optimizer_layout=layout)
    assert round(plan.modelled_step_time_s * 1e9) == best
    assert plan.stats["layout"] in [rec for t, _, rec in each if t == best]
    if budget is not None:
        assert plan.peak_memory_bytes <= budget
    return plan, each


@pytest.mark.parametrize("name,n", [("llama-tiny", 8), ("gpt-tiny", 4)])
def test_megatron_is_the_best_of_its_space(name, n):
    tg = _meta_trace(name)
    points = [(mesh, megatron(mesh, dp, tp, distributed_optimizer=z), rec)
              for mesh, dp, tp, z, rec in megatron_space(n)]
    plan, each = _check_best(tg, "megatron", points, n)
    assert len(each) == len(megatron_space(n))   # every point of the space runs on this model
    assert plan.stats["hints"] == "megatron" and all(v.kind == "spatial" for v in plan.nodes.values())


def test_megatron_distributed_optimizer_steps_and_holds_a_shard_of_the_state():
    """The distributed optimizer, run as ZeRO-2, shards weights, gradients and optimizer state
    over DP: each rank's optimizer step touches 1/dp of it and holds 1/dp of it plus the
    whole weights gathered once in forward and kept for backward, while the gradients'
    all-reduce becomes the weights' all-gather (in forward) and the gradients'
    reduce-scatter: the same bytes, twice the latencies. So every layout with it is smaller
    than the same layout without, its optimizer step 1/dp as long, and the search keeps
    whichever of the two is faster."""
    tg = _meta_trace("llama-tiny", batch=4, seq=16)
    n = 8
    points = [(mesh, megatron(mesh, dp, tp, distributed_optimizer=z), rec)
              for mesh, dp, tp, z, rec in megatron_space(n)]
    free = _solve_each(tg, points, None, "fp32-adam")
    by_layout = {}
    for t, peak, rec in free:
        by_layout.setdefault((rec["dp"], rec["tp"], rec["order"]), {})[rec["zero"]] = (t, peak)
    pairs = [v for v in by_layout.values() if len(v) == 2]
    assert len(pairs) >= 3
    for v in pairs:
        assert v[1][1] < v[0][1], v
    _check_best(tg, "megatron", points, n)
    # the DP-only layout with it: weights stored sharded over DP, the optimizer step over 1/dp,
    # the whole weights kept for backward counted once beside the 1/dp state
    mesh = (4,)
    plan = plan_graph(tg, CostModel(CLUSTER, mesh), None, megatron(mesh, 0, None, distributed_optimizer=True))
    plain = plan_graph(tg, CostModel(CLUSTER, mesh), None, megatron(mesh, 0, None))
    assert plan.stats["keep_gathered"] and "keep_gathered" not in plain.stats
    params = [(k, v) for k, v in plan.nodes.items() if v.role == "param" and v.mem_bytes]
    assert all(v.out[0][0] == "S" for _, v in params), params
    nodes = {nd.name: nd for nd in tg.graph.nodes}
    for k, v in params:  # each weight: 16 B per element of its quarter, and its whole fp32 copy kept
        numel = nodes[k].meta["val"].numel()
        assert v.mem_bytes == pytest.approx(numel * 16 / 4 + numel * 4) and plain.nodes[k].mem_bytes == numel * 16
    bd, bd_plain = breakdown(plan), breakdown(plain)
    assert bd["step_peak_bytes"] == pytest.approx(bd_plain["step_peak_bytes"] / 4, rel=1e-9)  # state + scratch
    assert bd["activation_bytes"] > bd_plain["activation_bytes"]  # the kept weights with them
    assert bd["optimizer_step_s"] == pytest.approx(bd_plain["optimizer_step_s"] / 4, rel=1e-6)


@pytest.mark.parametrize("name,n", [("llama-tiny", 8), ("gpt-tiny", 4)])
def test_fsdp_tp_is_the_best_of_its_space(name, n):
    tg = _meta_trace(name)
    points = [(mesh, fsdp_tp(mesh, dp, tp), rec) for mesh, dp, tp, rec in fsdp_space(n)]
    plan, _ = _check_best(tg, "fsdp-tp", points, n)
    dp_axis, _ = Layout(**plan.stats["layout"]).axes()
    params = [v for v in plan.nodes.values() if v.role == "param" and v.mem_bytes]
    # every weight stored sharded over the data-parallel axis (ZeRO-3)
    assert sum(v.out[dp_axis][0] == "S" for v in params) >= len(params) - 2


def test_fsdp_tp_never_nests_one_dim_with_dp_outer():
    """With DP the outer axis, FSDP shards another dim than TP's split, so the runtime gathers
    each weight over DP alone (one dim split on both would be gathered whole and sliced back)."""
    tg = _meta_trace("gpt-tiny")
    plan = search(tg, (2, 2), "primepar-v100", hints=fsdp_tp((2, 2), 0, 1))
    weights = [v.out for v in plan.nodes.values() if v.role == "param" and v.out[1] != "R"]
    assert weights and all(out[0][0] == "S" and out[0] != out[1] for out in weights), weights


def test_spatial_is_the_best_spatial_plan_of_every_mesh_shape():
    tg = _meta_trace("llama-tiny")
    # every mesh shape, its sharded weights regathered in backward (ZeRO-3) or kept (ZeRO-2)
    # over no axis, each axis alone, or every axis
    variants = {1: [(), (0,)], 2: [(), (0,), (1,), (0, 1)], 3: [(), (0,), (1,), (2,), (0, 1, 2)]}
    points = [(s, Hints(temporal=False, keep_gathered=kept), {"mesh": "x".join(map(str, s)), "temporal": False,
                                                              **({"kept": list(kept)} if kept else {})})
              for s in mesh_shapes(8) for kept in variants[len(s)]]
    plan, _ = _check_best(tg, "spatial", points, 8)
    assert set(plan.strategy_counts()) == {"spatial"}


@pytest.mark.parametrize("name,n,cluster,budget_gib", [("llama-tiny", 8, "primepar-v100", None),
                                                       ("gpt-tiny", 4, "cpu-local", None),
                                                       ("llama-tiny", 4, "dgx-h100", 0.004)])
def test_stpc_own_space_holds_every_baseline(name, n, cluster, budget_gib):
    """stpc's own search covers each baseline's space (a baseline's hints only narrow it, and
    Megatron's distributed optimizer, run as ZeRO-2, is the kept-weights half of stpc's
    points): its plan is never slower than the best baseline that fits."""
    tg = _meta_trace(name)
    budget = None if budget_gib is None else budget_gib * 2**30
    own = search(tg, n, cluster, budget_bytes=budget)
    for b in ("megatron", "fsdp-tp", "spatial"):
        try:
            base = search(tg, n, cluster, budget_bytes=budget, hints=b)
        except InfeasibleBudget:
            continue
        assert own.modelled_step_time_s <= base.modelled_step_time_s * (1 + 1e-9), (b, base.stats["layout"])


def test_stpc_keeps_gathered_weights_where_megatron_would_win_with_them():
    """llama2-7b (2 layers) on 16 H100s, bf16: Megatron's best layout is its distributed
    optimizer (ZeRO-2, weights gathered once per step and kept). Regathering every sharded
    weight in backward, stpc's points alone lose to it; with the kept-weights points of its
    own space (baselines.own_points) stpc's plan is faster than Megatron's, and the plan
    says how it runs its weights."""
    from stpc.cli._common import meta_trace

    tg, _, _ = meta_trace("llama2-7b", 8, 2048, "bf16", layers=2)
    cl = get_cluster("dgx-h100")
    kw = dict(budget_bytes=cl.default_budget_bytes, dtype="bf16", optimizer_layout="mixed-adam")
    meg = search(tg, 16, cl, hints="megatron", **kw)
    assert meg.stats["layout"]["zero"] == 1
    regathered = search(tg, 16, cl, hints=Hints(), **kw)   # (explicit hints: one point per shape)
    assert regathered.modelled_step_time_s > meg.modelled_step_time_s
    own = search(tg, 16, cl, **kw)
    assert own.modelled_step_time_s < meg.modelled_step_time_s
    assert own.stats["layout"].get("kept") and own.stats.get("keep_gathered")
    assert "kept for backward (ZeRO-2)" in describe_layout(own.stats["layout"])


def test_layouts_cover_both_orders_and_the_optimizer():
    from stpc.planner.baselines import layouts
    got = {(lay.dp, lay.tp, lay.order, lay.zero) for lay in layouts("megatron", 8)}
    want = {(r["dp"], r["tp"], r["order"], r["zero"]) for *_, r in megatron_space(8)}
    assert got == want
    assert {(lay.dp, lay.tp, lay.order) for lay in layouts("fsdp-tp", 8)} == {
        (r["dp"], r["tp"], r["order"]) for *_, r in fsdp_space(8)}
    lay = Layout(4, 8, "dp-outer", 1)
    assert lay.mesh_shape == (4, 8) and lay.axes() == (0, 1)
    assert Layout(4, 8, "tp-outer", 0).mesh_shape == (8, 4) and Layout(4, 8, "tp-outer", 0).axes() == (1, 0)
    assert Layout(1, 8, "-", 0).axes() == (None, 0) and Layout(8, 1, "-", 1).axes() == (0, None)


def test_plan_cli_prints_the_layout(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "stpc", "plan", "--model", "llama-tiny", "--mesh", "8",
                        "--cluster", "primepar-v100", "--batch", "8", "--seq", "64", "--hints", "megatron",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lay = json.loads(out.read_text())["layout"]
    assert set(lay) == {"dp", "tp", "order", "zero"} and lay["dp"] * lay["tp"] == 8
    assert f"layout: {Layout(**lay).describe()}" in r.stdout


@pytest.mark.slow
def test_megatron_llama2_7b_on_32_v100_is_the_best_dp_by_tp_layout():
    """The issue's case: llama2-7b, 32 V100 (8 nodes of 4), fp16. Every Megatron layout
    solved on its own; the preset finds the best (no longer TP over all 32 devices)."""
    tg = _meta_trace("llama2-7b", batch=8, seq=2048, dtype=torch.float16)
    points = [(mesh, megatron(mesh, dp, tp, distributed_optimizer=z), rec)
              for mesh, dp, tp, z, rec in megatron_space(32)]
    plan, each = _check_best(tg, "megatron", points, 32, budget=CLUSTER.device.mem_bytes, layout="mixed-adam")
    assert plan.stats["layout"]["tp"] < 32


@pytest.mark.parametrize("model,batch", [("gpt-tiny", 4), ("llama-tiny", 8)])
def test_sequence_parallel_splits_every_norm_and_residual_add_on_the_sequence(model, batch):
    # Megatron's --sequence-parallel / TorchTitan's SequenceParallel: between the linears the
    # activations of the model's width stay split on the sequence over the TP axis; by
    # default the solver picks that layout per op (on cpu-local, at these batches, it splits
    # some of them otherwise: on the batch, or not at all).
    tg = _meta_trace(model, batch=batch, n_layers=2)
    glue = sequence_parallel_nodes(tg.graph)
    norms_adds = {n.name for n in tg.graph.nodes if n.op == "call_function" and n.name in glue
                  and str(n.target).split(".")[1] in ("add", "layer_norm", "mul")}
    assert norms_adds and not any(str(n.target).split(".")[1] in ("linear", "embedding", "scaled_dot_product_attention")
                                  for n in tg.graph.nodes if n.name in glue)
    cm = CostModel(get_cluster("cpu-local"), (2, 2))
    free = plan_graph(tg, cm, hints=megatron((2, 2)))
    sp = plan_graph(tg, cm, hints=megatron((2, 2), sequence_parallel=True))
    decisions = {k: v for k, v in sp.nodes.items() if v.role == "decision"}
    assert all(decisions[k].out[1] == "S1" for k in norms_adds if k in decisions)
    assert any(free.nodes[k].out[1] != "S1" for k in norms_adds if k in decisions)  # (the switch changes the plan)
    # what SP saves is activations (the free plan may store its weights otherwise: gpt-tiny's
    # tied table vocab-split over TP, read whole by the embedding, not gathered again)
    act = [breakdown(p)["activation_bytes"] for p in (sp, free)]
    assert act[0] <= act[1]
    if model == "gpt-tiny":  # (llama-tiny's free plan splits those norms on the batch instead: as small)
        assert act[0] < act[1]
    lay = Layout(2, 2, "dp-outer", 0, sp=True)
    assert lay.as_dict()["sp"] is True and "sp" not in Layout(2, 2).as_dict()
    assert describe_layout(lay.as_dict()).endswith("sequence parallel")
    assert layout_hints("fsdp-tp", lay).sequence_parallel == 1


def test_sequence_parallel_on_a_sequence_the_axis_does_not_divide_names_the_node_and_the_fix():
    tg = _meta_trace("gpt-tiny", seq=6, n_layers=1)
    with pytest.raises(HintUnsatisfiable, match=r"node (add|layer_norm)\w* .*sequence length that divides by 4"):
        plan_graph(tg, CostModel(get_cluster("cpu-local"), (4,)), hints=megatron((4,), sequence_parallel=True))


def test_stpc_own_space_holds_megatrons_distributed_optimizer_on_a_2d_mesh():
    """bloom-176b (2 layers) on 8 V100s, fp16: Megatron's best layout keeps its gathered
    weights over the DP axis only (distributed optimizer, run as ZeRO-2) while TP splits
    weights on the other. Keeping over every axis charges each TP-split weight a whole
    kept copy and fits no budget (without recomputing the layers, whose replay gathers their
    weights again); stpc's own points keep over each axis alone too, so its
    plan is at least as fast as Megatron's, and says over which axis it keeps."""
    from stpc.cli._common import meta_trace

    tg, _, _ = meta_trace("bloom-176b", None, None, "fp16", layers=2)
    cl = get_cluster("primepar-v100")
    kw = dict(budget_bytes=cl.default_budget_bytes, dtype="fp16", optimizer_layout="mixed-adam")
    meg = search(tg, "2x4", cl, hints="megatron", **kw)
    assert meg.stats["layout"]["zero"] == 1
    with pytest.raises(InfeasibleBudget):
        search(tg, "2x4", cl, hints=Hints(keep_gathered=(0, 1), recompute="none"), **kw)
    own = search(tg, "2x4", cl, **kw)
    assert own.modelled_step_time_s <= meg.modelled_step_time_s * (1 + 1e-9)
    assert own.stats["layout"]["kept"] == [0] and own.stats["keep_gathered"] == [0]
    assert describe_layout(own.stats["layout"]).endswith("kept for backward (ZeRO-2) over mesh axis 0")
