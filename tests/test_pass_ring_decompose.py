"""ring_decompose: AG->matmul, matmul->RS and P2x2 become P2P ring schedules."""
import torch

from _graphs import targets, traced_and_plan
from stpc import runtime
from stpc.passes import insert_collectives, ring_decompose, shard_params

aten = torch.ops.aten


def _before_after(model, mesh, family, **kw):
    tg, plan = traced_and_plan(model, mesh, family, **kw)
    gm = insert_collectives(shard_params(tg.gm, plan), plan)
    before = targets(gm)
    tagged = [n.name for n in gm.graph.nodes if n.meta.get("ring") and "comm" in n.meta]
    gm = ring_decompose(gm, plan)
    return plan, before, targets(gm), tagged, gm


def test_ag_and_rs_rings_replace_their_collectives():
    plan, before, after, tagged, gm = _before_after("llama-tiny", "4", "ag_rs")
    counts = plan.strategy_counts()
    # Before: one all-gather per AG-ring linear, one reduce-scatter per RS-ring linear
    assert before["ring_allgather_matmul"] == 0 and len(tagged) == counts["ag_ring"] + counts["rs_ring"]
    # After: the expected ring ops, and none of the tagged collectives
    assert after["ring_allgather_matmul"] == counts["ag_ring"]
    assert after["ring_matmul_reducescatter"] == counts["rs_ring"]
    assert after["all_gather"] == before["all_gather"] - counts["ag_ring"]
    assert after["reduce_scatter"] == before["reduce_scatter"] - counts["rs_ring"]
    for n in gm.graph.nodes:
        if n.target in (runtime.all_gather, runtime.reduce_scatter):
            assert not n.meta.get("ring"), n.name
    # the ring op keeps the linear's placement and local value
    r = next(n for n in gm.graph.nodes if n.target is torch.ops.stpc.ring_allgather_matmul.default)
    assert r.meta["placement"] == ("S2",) and tuple(r.meta["val"].shape) == (4, 16, 8)
    assert r.args[1].target is aten.t.default  # ring ops take the [N, K] weight


def test_p2x2_nodes_become_primepar_step_schedules():
    plan, before, after, tagged, gm = _before_after("llama-tiny", "4", "p2x2")
    n = plan.strategy_counts()["p2x2"]
    assert before["grid_linear"] == n
    assert after["primepar_linear"] == n and after["grid_linear"] == 0
    assert after["all_gather"] == before["all_gather"]  # nothing else changed


def test_graph_without_rings_is_unchanged():
    plan, before, after, tagged, gm = _before_after("gpt-tiny", "2x2", "megatron")
    assert not tagged and before == after
