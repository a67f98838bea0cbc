"""shard_params: placeholders become the local shards the plan stores them in.

Expects: a graph made by ``stpc.trace`` (placeholders = parameters/buffers, then
user inputs) and a Plan of that graph.

Guarantees:
  * every parameter, buffer and user-input placeholder has meta["val"] = the
    LOCAL FakeTensor of its plan placement (``plan.nodes[name].out``), the full
    value kept in meta["global_val"] and the placement in meta["placement"];
    the caller passes each rank's shard (``stpc.runtime.shard_tensor``), not
    the full tensor — parameters are stored sharded (ZeRO-style when the
    consumer wants them whole: ``insert_collectives`` gathers them);
  * the program's tensors live on ``device``: ``device=`` arguments the trace
    baked in (``meta`` when planning a model built on the meta device) are
    retargeted, in the graph and in the subgraphs of higher-order ops, so
    arange/ones/full tables are made where the run happens;
  * ``gm.meta`` records the mesh shape, one process-group name per mesh axis and
    the device: the later passes read them.

It adds no node: resharding is ``insert_collectives``' job.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ._common import default_groups, fail, fake_mode_of, finish, mesh_of, set_local
from stpc.placement import fits, fmt


def _retarget_devices(gm: fx.GraphModule, device: torch.device) -> None:
    """Every device argument (``device=`` or positional, as in ``x.to(other.device)``)
    becomes the run's device."""
    changed = False
    swap = lambda a: device if isinstance(a, torch.device) else a  # noqa: E731
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(node.kwargs, swap)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed = True
    if changed:
        gm.recompile()


def shard_params(gm: fx.GraphModule, plan, *, groups: list[str] | None = None,
                 device: str | torch.device = "cpu") -> fx.GraphModule:
    """Make parameter/buffer/input placeholders local shards; see the module docstring."""
    mesh = mesh_of(plan)
    device = torch.device(device)
    groups = list(groups) if groups is not None else default_groups(mesh)
    if len(groups) != len(mesh):
        raise ValueError(f"shard_params: {len(groups)} group names for a mesh of {len(mesh)} axes {mesh}")
    mode = fake_mode_of(gm)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            np = plan.nodes.get(node.name)
            placement = tuple(np.out) if np is not None else ("R",) * len(mesh)
            if not fits(tuple(val.shape), placement, mesh):
                raise fail(node, f"shape {tuple(val.shape)} does not split evenly as {fmt(placement)} "
                                 f"on mesh {mesh}", "choose batch/sequence sizes divisible by the mesh, "
                                 "or re-plan for this shape")
            set_local(node, placement, mesh, mode, device, global_val=val)
    for sub in gm.modules():  # the graph and the subgraphs of higher-order ops (e.g. no_grad regions)
        if isinstance(sub, fx.GraphModule):
            _retarget_devices(sub, device)
    gm.meta["stpc_mesh"] = mesh
    gm.meta["stpc_groups"] = groups
    gm.meta["stpc_device"] = device
    return finish(gm)
