"""cleanup: asserts, duplicate reshards, gather->slice pairs and dead code go."""
import torch

from _graphs import targets, traced_and_plan
from stpc import runtime
from stpc.passes import cleanup, insert_collectives, shard_params


def test_duplicate_reshards_merge_and_asserts_and_dead_placeholders_go():
    tg, plan = traced_and_plan("gpt-tiny", "2x2", "megatron")
    gm = insert_collectives(shard_params(tg.gm, plan), plan)
    # layer_norm feeds q, k and v: the same reshard is emitted once per consumer
    ln = next(n for n in gm.graph.nodes if n.name == "layer_norm")
    assert len(ln.users) == 3
    calls = {(u.target, tuple(sorted(u.kwargs.items()))) for u in ln.users}
    assert len(calls) == 1
    (reshard, _), = calls
    before = targets(gm)
    assert any(n.name == "p_wte_weight" for n in gm.graph.nodes)  # the tied head's unused twin
    gm = cleanup(gm, plan)
    after = targets(gm)
    assert len(ln.users) == 1
    assert after[reshard.__name__] <= before[reshard.__name__] - 2  # (the next layer's norm merges alike)
    assert after.get("_assert_tensor_metadata", 0) == 0
    assert not any(n.name == "p_wte_weight" for n in gm.graph.nodes)


def test_gather_then_slice_back_cancels():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ag = g.call_function(runtime.all_gather, (x,), {"dim": 1, "grad": "slice", "group": "g0"})
    sl = g.call_function(runtime.shard_slice, (ag,), {"dim": 1, "group": "g0"})
    y = g.call_function(torch.ops.aten.relu.default, (sl,))
    g.output(y)
    for n in (ag, sl):
        n.meta["comm"] = {"op": n.target.__name__, "axis": 0}
    gm = cleanup(torch.fx.GraphModule(torch.nn.Module(), g))
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert next(iter(gm.graph.nodes)).next.args[0].name == "x"
