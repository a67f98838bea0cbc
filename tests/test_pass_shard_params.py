"""shard_params: placeholders become the local shards of their plan placement."""
import torch

from _graphs import traced_and_plan
from stpc.passes import shard_params
from stpc.placement import local_shape


def test_params_and_inputs_become_local_shards():
    tg, plan = traced_and_plan("gpt-tiny", "2x2", "megatron")
    before = {n.name: tuple(n.meta["val"].shape) for n in tg.gm.graph.nodes if n.op == "placeholder"}
    gm = shard_params(tg.gm, plan, groups=["dp", "tp"])
    mesh = tuple(plan.mesh_shape)
    seen_split = 0
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        placement = tuple(plan.nodes[n.name].out)
        assert n.meta["placement"] == placement
        assert tuple(n.meta["global_val"].shape) == before[n.name]
        assert tuple(n.meta["val"].shape) == local_shape(before[n.name], placement, mesh)
        seen_split += tuple(n.meta["val"].shape) != before[n.name]
    assert seen_split > 0  # Megatron splits the projections
    # q_proj is column-parallel on the tp axis: [32, 32] -> [16, 32] locally
    q = next(n for n in gm.graph.nodes if n.name == "p_layers_0_attn_q_proj_weight")
    assert tuple(q.meta["val"].shape) == (16, 32)
    assert gm.meta["stpc_groups"] == ["dp", "tp"] and gm.meta["stpc_mesh"] == (2, 2)


def test_device_arguments_are_retargeted():
    tg, plan = traced_and_plan("llama-tiny", "4", "dp")
    assert any(n.kwargs.get("device") == torch.device("meta") for n in tg.gm.graph.nodes)
    gm = shard_params(tg.gm, plan)
    devs = {n.kwargs["device"] for n in gm.graph.nodes if "device" in n.kwargs}
    assert devs == {torch.device("cpu")}
    assert "stpc_mesh" in gm.meta
