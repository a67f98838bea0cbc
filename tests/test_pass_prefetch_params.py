"""prefetch_params: ZeRO parameter gathers become one coalesced gather per layer, issued one
layer ahead of its use."""
import copy
import operator

import torch.fx as fx
from _graphs import targets, traced_and_plan
from stpc import runtime
from stpc.passes import cleanup, insert_collectives, prefetch_params, ring_decompose, shard_params, verify


def _lowered(model, mesh, family):
    tg, plan = traced_and_plan(model, mesh, family)
    gm = shard_params(tg.gm, plan, groups=["g0", "g1"][:len(plan.mesh_shape)])
    return plan, cleanup(ring_decompose(insert_collectives(gm, plan), plan), plan)


def _param_gathers(gm):
    return [n for n in gm.graph.nodes if n.target is runtime.all_gather and n.args[0].op == "placeholder"]


def test_zero_gathers_coalesce_per_layer_and_prefetch():
    plan, gm = _lowered("llama-tiny", "4", "zero")
    before = _param_gathers(gm)
    params = {n.args[0].name for n in before}
    assert len(before) >= 18  # every weight of both layers, the embedding and the head
    gm = prefetch_params(gm, plan)
    assert not _param_gathers(gm)
    starts = [n for n in gm.graph.nodes if n.target is runtime.gather_start]
    waits = [n for n in gm.graph.nodes if n.target is runtime.gather_wait]
    assert len(starts) == len(waits) < len(before) / 3
    # every parameter gathered exactly once, and the layers' gathers hold the layers' weights
    carried = [s.name for n in starts for s in n.args[0]]
    assert sorted(carried) == sorted(params)
    per_layer = {i: {s.name for s in n.args[0]} for i, n in enumerate(starts)}
    layer0 = next(k for k, v in per_layer.items() if "p_layers_0_mlp_down_proj_weight" in v)
    assert all(name.startswith("p_layers_0_") for name in per_layer[layer0])
    assert {f"p_layers_0_{m}" for m in ("attn_q_proj_weight", "mlp_up_proj_weight")} <= per_layer[layer0]
    # each wait sits right before its group's first consumer; each later start right after the
    # previous group's wait, before that group's compute (one layer ahead)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k, (start, wait) in enumerate(zip(starts, waits)):
        first_use = min(order[u] for g in wait.users for u in g.users)
        assert order[wait] < first_use
        if k:
            assert order[waits[k - 1]] < order[start] < min(order[u] for g in waits[k - 1].users for u in g.users)
        assert start.meta["comm"]["flat_numel"] == sum(s.meta["val"].numel() for s in start.args[0])
    # the head's gathers (after the last layer's: the final norm and the output projection)
    # are kept for their backward, which runs first; no layer's, nor the embedding's
    kept = [{s.name for s in start.args[0]} for start, wait in zip(starts, waits) if wait.kwargs.get("keep")]
    assert kept and set().union(*kept) >= {"p_norm_weight", "p_lm_head_weight"}, per_layer
    assert not any(name.startswith(("p_layers_", "p_embed")) for group in kept for name in group), kept
    last_layer = max(k for k, v in per_layer.items() if any(n.startswith("p_layers_1_") for n in v))
    assert all(bool(w.kwargs.get("keep")) == (k > last_layer) for k, w in enumerate(waits)), per_layer
    verify(gm, plan)  # every rank issues the same coalesced gathers


def test_plans_without_sharded_parameters_are_unchanged():
    plan, gm = _lowered("llama-tiny", "2x2", "dp")
    before = targets(gm)
    assert not _param_gathers(gm)
    gm = prefetch_params(gm, plan)
    assert targets(gm) == before


def _chained(gm):
    """Gathers that read another gather's output (a parameter gathered axis by axis)."""
    return [n for n in gm.graph.nodes if n.target is runtime.all_gather and isinstance(n.args[0], fx.Node)
            and n.args[0].target in (runtime.all_gather, operator.getitem)
            and (n.args[0].target is runtime.all_gather or n.args[0].args[0].target is runtime.gather_wait)]


def test_a_parameter_split_over_two_axes_is_gathered_once_over_both():
    # Before: ZeRO on a 2x2 mesh stores each weight split on one dim over both axes; the
    # lowering gathers it axis by axis, so the second gather of each reads the first's output
    plan, gm = _lowered("llama-tiny", "2x2", "zero")
    chains = [n for n in _param_gathers(gm) if len(n.users) == 1 and next(iter(n.users)).target is runtime.all_gather
              and next(iter(n.users)).kwargs["dim"] == n.kwargs["dim"]]
    assert len(chains) >= 10
    whole = {n.args[0].name: next(iter(n.users)).meta["val"].shape for n in chains}
    # without joint groups (a graph lowered outside stpc.compile) the chains stay, second gathers uncoalesced
    kept = prefetch_params(copy.deepcopy(gm), plan)
    assert len(_chained(kept)) == len(chains)
    # Expected: with the joint group of axes (0, 1), one coalesced gather per layer over it
    gm.meta["stpc_joint_groups"] = {(0, 1): "g01"}
    gm = prefetch_params(gm, plan)
    assert not _chained(gm) and not _param_gathers(gm)
    starts = [n for n in gm.graph.nodes if n.target is runtime.gather_start]
    joint = [n for n in starts if n.args[1] == "g01"]
    assert {s.name for n in joint for s in n.args[0]} == set(whole)
    assert all(n.meta["comm"]["axis"] == (0, 1) for n in joint)
    for wait in (n for n in gm.graph.nodes if n.target is runtime.gather_wait and n.args[3] == "g01"):
        for got, src in zip(sorted(wait.users, key=lambda u: u.args[1]), wait.args[0].args[0]):
            assert got.meta["val"].shape == whole[src.name]  # each parameter whole after one gather
    verify(gm, plan)  # every rank of each joint group issues the same gathers


def test_the_heads_gathers_are_kept_where_no_layers_weights_are_gathered():
    # only the head's weight stored split and read whole (data parallel on 4, every other
    # weight replicated): the head's group is still the head's (its reader comes after the
    # last layer's last op), so it is kept, as the planner charges it (Builder._kept_head_edges)
    import torch
    from _graphs import B, S
    from stpc import models, trace
    from stpc.planner import Hints, search

    with torch.device("meta"):
        tg = trace(models.build("llama-tiny"), models.example_inputs("llama-tiny", B, S))
    hints = Hints(force=[(r"^linear", lambda s: s.kind == "spatial" and all(t == "R" for t in s.ins[1]))],
                  param_force=[(r"^lm_head\.weight$", lambda p: p[0][0] == "S"),
                               (r"^(?!lm_head\.)", lambda p: p[0] == "R")], temporal=False)
    plan = search(tg, (4,), "cpu-local", hints=hints)
    gm = cleanup(ring_decompose(insert_collectives(shard_params(tg.gm, plan, groups=["g0"]), plan), plan), plan)
    assert {n.args[0].name for n in _param_gathers(gm)} == {"p_lm_head_weight"}
    gm = prefetch_params(gm, plan)
    waits = [n for n in gm.graph.nodes if n.target is runtime.gather_wait]
    assert len(waits) == 1 and waits[0].kwargs.get("keep") is True
    assert [s.name for s in waits[0].args[0].args[0]] == ["p_lm_head_weight"]
