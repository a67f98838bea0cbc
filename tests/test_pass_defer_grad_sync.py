"""defer_grad_sync: the per-use gradient all-reduces of data-parallel parameters leave the
graph for the bucketed reducer, and only where every path of the parameter has one."""
import re

import torch

from _graphs import targets, traced_and_plan
from _multirank import whole_embedding_hints
from stpc import runtime
from stpc.passes import cleanup, defer_grad_sync, insert_collectives, ring_decompose, shard_params


def _lowered(model, mesh, family):
    tg, plan = traced_and_plan(model, mesh, family)
    groups = ["g0", "g1"][:len(plan.mesh_shape)]
    gm = shard_params(tg.gm, plan, groups=groups)
    gm = cleanup(ring_decompose(insert_collectives(gm, plan), plan), plan)
    gm.meta["stpc_tied_params"] = dict(tg.tied_params)
    return tg, plan, gm


def _param_reads(gm, name):
    """The grad_all_reduce nodes reading placeholder ``name`` directly."""
    ph = next(n for n in gm.graph.nodes if n.name == name)
    return [u for u in ph.users if u.target is runtime.grad_all_reduce]


def test_data_parallel_parameters_are_deferred_in_ready_order():
    tg, plan, gm = _lowered("llama-tiny", "4", "dp")
    before = targets(gm)["grad_all_reduce"]
    params = [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("param")]
    through_f = {p for p in params if _param_reads(gm, p)}
    linears = {p for p in params if p.endswith("proj_weight") or p == "p_lm_head_weight"}
    gm = defer_grad_sync(gm, plan)
    deferred = gm.meta["stpc_deferred_grads"]
    # every linear weight is read by batch-split work only (through one f): each f goes;
    # what the plan computes on the whole batch (here the tiny model's norms, embedding)
    # has a complete gradient already and no f to defer
    assert linears <= set(deferred) == through_f and all(g == ["g0"] for g in deferred.values())
    assert targets(gm)["grad_all_reduce"] == before - len(deferred)
    assert not any(_param_reads(gm, p) for p in params)
    # ready order: the head (used last in forward) first, then layer 1 before layer 0
    order = list(deferred)
    assert order[0] == "p_lm_head_weight"
    assert order.index("p_layers_1_mlp_down_proj_weight") < order.index("p_layers_0_mlp_down_proj_weight")
    assert order.index("p_layers_0_mlp_down_proj_weight") < order.index("p_layers_0_attn_q_proj_weight")
    gm.graph.lint()


def test_two_data_parallel_axes_defer_over_both():
    _, plan, gm = _lowered("llama-tiny", "2x2", "dp")
    gm = defer_grad_sync(gm, plan)
    assert set(map(tuple, gm.meta["stpc_deferred_grads"].values())) == {("g0", "g1")}
    assert targets(gm)["grad_all_reduce"] == 0


def test_tied_parameter_read_whole_by_one_consumer_keeps_its_reduction():
    # gpt-tiny's head is tied to the embedding. Embedding the whole batch on every rank makes
    # the weight's gradient there complete, so summing the tied parameter's gradient over the
    # axis would double that part: it must stay reduced where it is used
    from stpc.planner import search

    tg, _ = traced_and_plan("gpt-tiny", "4", "dp")
    assert tg.tied_params == {"p_lm_head_weight": "p_wte_weight"}
    whole = whole_embedding_hints()
    plan = search(tg, (4,), "cpu-local", hints=whole)
    gm = cleanup(ring_decompose(insert_collectives(shard_params(tg.gm, plan, groups=["g0"]), plan), plan), plan)
    gm.meta["stpc_tied_params"] = dict(tg.tied_params)
    gm = defer_grad_sync(gm, plan)
    deferred = gm.meta["stpc_deferred_grads"]
    assert "p_lm_head_weight" not in deferred and len(deferred) > 10
    (kept,) = _param_reads(gm, "p_lm_head_weight")
    # ... and backward does not wait for it: autograd sums it with the embedding's complete
    # gradient at the end of backward, which is what first reads it
    assert kept.kwargs == {"group": "g0", "wait": "on_read"}
    # the dp preset embeds each rank's rows: both uses partial, the tied parameter is deferred
    _, plan, gm = _lowered("gpt-tiny", "4", "dp")
    gm = defer_grad_sync(gm, plan)
    assert "p_lm_head_weight" in gm.meta["stpc_deferred_grads"]
    assert not _param_reads(gm, "p_lm_head_weight")


def test_activation_reductions_of_tensor_parallelism_stay():
    # pure TP: the linears' weights are split, not replicated over a data axis; the f's on
    # activations (a replicated norm output read by column-parallel linears) stay. Only a
    # norm's weight read by sequence-split work (where the solver keeps a norm split on the
    # sequence) has a gradient to sum, and it alone is deferred to the reducer.
    _, plan, gm = _lowered("gpt-tiny", "4", "megatron")
    weight_sums = sum(1 for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "")
                      == "grad_all_reduce" and n.args[0].op == "placeholder")
    before = targets(gm)["grad_all_reduce"]
    gm = defer_grad_sync(gm, plan)
    deferred = gm.meta["stpc_deferred_grads"]
    assert all(re.search(r"(^|_)ln", name) for name in deferred), deferred
    assert len(deferred) == weight_sums
    assert targets(gm)["grad_all_reduce"] == before - weight_sums > 0
    # an activation's gradient is read by the next op of backward: those wait where they stand
    assert all("wait" not in n.kwargs for n in gm.graph.nodes if n.target is runtime.grad_all_reduce)


def _graph(second_reads_through_f: bool):
    g = torch.fx.Graph()
    w = g.placeholder("w")
    w.meta["param"] = "w"
    x = g.placeholder("x")
    f1 = g.call_function(runtime.grad_all_reduce, (w,), {"group": "g0"})
    f1.meta["comm"] = {"op": "grad_all_reduce", "axis": 0}
    y1 = g.call_function(torch.ops.aten.mm.default, (x, f1))
    w2 = w
    if second_reads_through_f:
        w2 = g.call_function(runtime.grad_all_reduce, (w,), {"group": "g0"})
        w2.meta["comm"] = {"op": "grad_all_reduce", "axis": 0}
    y2 = g.call_function(torch.ops.aten.mm.default, (y1, w2))
    g.output(y2)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gm.meta["stpc_groups"] = ["g0"]
    return gm


def test_every_path_must_be_partial():
    # Before: w read twice, both through f -> Expected: both f's gone, w deferred on g0
    gm = defer_grad_sync(_graph(True))
    assert gm.meta["stpc_deferred_grads"] == {"w": ["g0"]}
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.aten.mm.default] * 2
    # Before: one read through f, one whole -> Expected: the f stays (w's gradient is a mix),
    # waited where autograd sums w's two gradients
    gm = defer_grad_sync(_graph(False))
    assert gm.meta["stpc_deferred_grads"] == {}
    (f,) = [n for n in gm.graph.nodes if n.target is runtime.grad_all_reduce]
    assert f.kwargs == {"group": "g0", "wait": "on_read"}


def _shared(w2_read_whole: bool):
    """w1 + w2 (computed from parameters alone) read through an f by batch-split work;
    w2 also read directly by whole work when ``w2_read_whole``."""
    g = torch.fx.Graph()
    w1, w2 = g.placeholder("w1"), g.placeholder("w2")
    w1.meta["param"], w2.meta["param"] = "w1", "w2"
    x = g.placeholder("x")
    s = g.call_function(torch.ops.aten.add.Tensor, (w1, w2))
    f = g.call_function(runtime.grad_all_reduce, (s,), {"group": "g0"})
    f.meta["comm"] = {"op": "grad_all_reduce", "axis": 0}
    y = g.call_function(torch.ops.aten.mm.default, (x, f))
    if w2_read_whole:
        y = g.call_function(torch.ops.aten.mm.default, (y, w2))
    g.output(y)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gm.meta["stpc_groups"] = ["g0"]
    return gm


def test_computation_from_parameters_alone_defers_to_its_parameters():
    # Before: add(w1, w2) -> f -> mm. Expected: f gone, both parameters deferred (the sum's
    # values are the same on every rank, so its backward maps the partial gradient onto
    # partial gradients of w1 and w2)
    gm = defer_grad_sync(_shared(False))
    assert gm.meta["stpc_deferred_grads"] == {"w1": ["g0"], "w2": ["g0"]}
    assert targets(gm)["grad_all_reduce"] == 0
    # Before: the same, and w2 also read whole. Expected: unchanged: w2's gradient is a mix,
    # so the f both share must stay, and with it w1's reduction
    gm = defer_grad_sync(_shared(True))
    assert gm.meta["stpc_deferred_grads"] == {}
    (f,) = [n for n in gm.graph.nodes if n.target is runtime.grad_all_reduce]
    assert f.kwargs["wait"] == "on_read"


def test_position_embedding_is_deferred_not_reduced_in_backward():
    # gpt's learned positions: embedding(wpe, arange(S)) is computed whole on every rank and
    # read by the batch-split residual add through an f. That f, in backward, waited behind
    # every gradient bucket in flight; it goes, and wpe joins the buckets
    _, plan, gm = _lowered("gpt-tiny", "4", "dp")
    wpe = next(n for n in gm.graph.nodes if n.name == "p_wpe_weight")
    (emb,) = wpe.users
    assert [u.target for u in emb.users] == [runtime.grad_all_reduce]
    gm = defer_grad_sync(gm, plan)
    assert gm.meta["stpc_deferred_grads"]["p_wpe_weight"] == ["g0"]
    assert all(u.target is torch.ops.aten.add.Tensor for u in emb.users)
    gm.graph.lint()


def test_a_parameter_stored_split_keeps_its_f():
    # ZeRO-2 over the axis and GPT's position embedding looked up whole on every rank: the
    # weight, stored split, is gathered whole (backward: this rank's slice), looked up, and
    # read by batch-split work through an f. Its local gradient is a slice of a partial sum:
    # the reducer's all-reduce would add different rows together. The f stays, ahead of the
    # gather's slice, and the parameter is not deferred.
    tg, plan, gm = _lowered("gpt-tiny", "4", "megatron-zero-whole-positions")
    ph = next(n for n in gm.graph.nodes if n.name == "p_wpe_weight")
    assert ph.meta["placement"][0].startswith("S")  # stored split over the one axis
    gm = defer_grad_sync(gm, plan)
    assert "p_wpe_weight" not in gm.meta["stpc_deferred_grads"]

    def source(n):  # through the gather's nodes to the placeholder
        while n.op == "call_function" and n.target is not torch.ops.aten.embedding.default:
            n = n.args[0]
        return n

    lookup = [n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default and source(n.args[0]) is ph]
    assert len(lookup) == 1 and [u.target for u in lookup[0].users] == [runtime.grad_all_reduce]
    # nothing stored split is deferred (here every parameter is: ZeRO-2 over the one axis)
    placements = {n.name: n.meta.get("placement") for n in gm.graph.nodes if n.op == "placeholder"}
    assert all(placements[p] == ("R",) for p in gm.meta["stpc_deferred_grads"])
    gm.graph.lint()
