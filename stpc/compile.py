"""stpc.compile: the one place that strings the stages together.

    dm = stpc.compile(model, mesh, example_inputs)      # on every rank
    loss = dm(idx, targets)                             # full inputs; each rank slices its own
    loss.backward(); opt = torch.optim.AdamW(dm.local_parameters().values())

trace (frontend) -> analyse + search (planner, unless a Plan is given) -> rank
agreement on the plan (runtime) -> passes (shard_params, insert_collectives,
ring_decompose, cleanup, verify) -> optional torch.compile of the resulting GraphModule.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from stpc import frontend, passes, runtime
from stpc.frontend.dump import dot as _dot
from stpc.frontend.dump import table as _table
from stpc.placement import fmt
from stpc.planner import Plan, analyse, search

__all__ = ["compile", "trace", "DistributedModel", "run_passes", "make_mesh"]


def trace(model: nn.Module, example_inputs: tuple, name: str = "") -> frontend.TracedGraph:
    """Trace ``model`` to an annotated aten graph (``stpc.frontend.trace``) and analyse it
    for the planner (``stpc.planner.analyse``: mesh-independent, done once and reused by
    every mesh shape and search). Works on ``meta`` tensors: nothing is allocated."""
    tg = frontend.trace(model, example_inputs, name)
    analyse(tg)
    return tg


class _Placements:
    """Adapter for ``stpc.frontend.dump``: a node's placement column after the passes (its local
    placement, and for communication nodes what they do)."""

    def __init__(self, gm: fx.GraphModule):
        self.info = {}
        for n in gm.graph.nodes:
            p = n.meta.get("placement")
            s = fmt(p) if p is not None else ""
            c = n.meta.get("comm")
            if c:
                extra = {k: v for k, v in c.items() if k not in ("op", "axis", "group", "edge", "p2p", "size")}
                s += f"  <{c['op']}@axis{c['axis']}" + "".join(f" {k}={v}" for k, v in extra.items()) + ">"
            if n.meta.get("ring") and not c:
                s += f"  [{n.meta['ring']['kind']}@axis{n.meta['ring']['axis']}]"
            self.info[n.name] = s

    def describe(self, name: str) -> str:
        return self.info.get(name, "")


def run_passes(gm: fx.GraphModule, plan: Plan, groups: list[str] | None = None, device="cpu",
               on_pass=None) -> fx.GraphModule:
    """shard_params -> insert_collectives -> ring_decompose -> cleanup -> verify, for a
    program whose tensors live on ``device``. ``on_pass(name, gm)`` is called after each
    (e.g. to dump the graph)."""
    if on_pass:
        on_pass("traced", gm)
    gm = passes.shard_params(gm, plan, groups=groups, device=device)
    if on_pass:
        on_pass("shard_params", gm)
    for name in ("insert_collectives", "ring_decompose", "cleanup", "verify"):
        gm = getattr(passes, name)(gm, plan)
        if on_pass:
            on_pass(name, gm)
    return gm


def default_device_type() -> str:
    """The device type of this world's ranks: CUDA under NCCL, CPU otherwise (gloo)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """Where this rank's tensors live on ``mesh``: its current CUDA device, or the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def make_mesh(mesh, plan_shape):
    """A DeviceMesh of ``plan_shape`` over the ranks of ``mesh`` (a DeviceMesh, whose ranks
    are viewed row-major in the plan's shape, or None for all ranks on the world's device
    type)."""
    plan_shape = tuple(int(n) for n in plan_shape)
    if mesh is None or not isinstance(mesh, DeviceMesh):
        if math.prod(plan_shape) != dist.get_world_size():
            raise ValueError(f"the plan's mesh {plan_shape} needs {math.prod(plan_shape)} ranks; "
                             f"the world has {dist.get_world_size()}")
        return init_device_mesh(default_device_type(), plan_shape)
    if tuple(mesh.shape) == plan_shape:
        return mesh
    if mesh.size() != math.prod(plan_shape):
        raise ValueError(f"the plan's mesh {plan_shape} does not fit the DeviceMesh of shape "
                         f"{tuple(mesh.shape)}; re-plan for {mesh.size()} devices")
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(plan_shape))


class DistributedModel:
    """A model compiled to an SPMD program over a DeviceMesh; call it on every rank.

    ``dm(*full_inputs)`` slices the user inputs as the plan says and returns the
    replicated output (loss). ``local_parameters()`` are this rank's shards
    (leaf tensors with requires_grad: give them to any torch.optim optimizer).
    """

    def __init__(self, gm, plan, mesh, groups, tg, model, snapshots, backend=None, input_specs=()):
        self.graph_module = gm
        self._input_specs = list(input_specs)  # (shape, dtype) of each compiled user input
        self.plan = plan
        self.mesh = mesh
        self.device = mesh_device(mesh)  # where this rank's shards and inputs live
        self.groups = groups
        self._snapshots = snapshots
        self.coords = tuple(int(c) for c in mesh.get_coordinate())
        shape = tuple(plan.mesh_shape)
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(dict(model.named_buffers(remove_duplicate=False)))
        canon = {}
        for fqn, t in list(model.named_parameters()) + list(model.named_buffers()):
            canon.setdefault(id(t), fqn)
        fqns = {**tg.param_fqns, **tg.buffer_fqns}
        self._params: dict[str, torch.Tensor] = {}
        self._placement: dict[str, tuple] = {}
        self._feed: list[tuple[str, object]] = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            placement = tuple(node.meta.get("placement", ("R",) * len(shape)))
            if node.name in fqns:
                full = named[fqns[node.name]]
                key = canon[id(full)]
                if key in self._params:
                    if self._placement[key] != placement:
                        raise NotImplementedError(
                            f"stpc.compile: parameter {key} is read through two placeholders with "
                            f"different placements {fmt(self._placement[key])} and {fmt(placement)}; "
                            f"force one placement for it with Hints.param_force")
                else:
                    local = runtime.shard_tensor(full.detach(), placement, shape, self.coords).to(
                        self.device, copy=True)
                    if node.name in tg.param_fqns:
                        local = nn.Parameter(local, requires_grad=full.requires_grad)
                    self._params[key] = local
                    self._placement[key] = placement
                self._feed.append(("param", key))
            else:
                self._feed.append(("input", (tg.user_inputs.index(node.name), placement)))
        self._fn = torch.compile(gm, backend=backend) if backend else gm

    def __call__(self, *inputs):
        self._check_inputs(inputs)
        shape = tuple(self.plan.mesh_shape)
        args = []
        for kind, what in self._feed:
            if kind == "param":
                args.append(self._params[what])
            else:
                i, placement = what
                args.append(runtime.shard_tensor(inputs[i], placement, shape, self.coords).to(self.device))
        out = self._fn(*args)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out

    forward = __call__

    def _check_inputs(self, inputs) -> None:
        """The plan is made for the compiled input shapes: any other shape is refused here,
        on every rank alike, before any communication (never sliced unevenly)."""
        if len(inputs) != len(self._input_specs):
            raise TypeError(f"stpc: the model was compiled for {len(self._input_specs)} inputs, got "
                            f"{len(inputs)}")
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self._input_specs)):
            got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (None, type(x).__name__)
            if got != (shape, dtype):
                raise ValueError(
                    f"stpc: input {i} has shape {got[0]} and dtype {got[1]}; the model was compiled for "
                    f"shape {shape} and dtype {dtype}. Fix: pass inputs of the compiled shape, or "
                    f"stpc.compile the model again with example inputs of this shape (a plan is made "
                    f"for one shape)")

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """FQN -> this rank's shard of each parameter (tied parameters once)."""
        return {k: v for k, v in self._params.items() if isinstance(v, nn.Parameter)}

    def placements(self) -> dict[str, tuple]:
        return dict(self._placement)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """FQN -> the full gradient, gathered from every rank (a collective: call on all ranks)."""
        out = {}
        for k, p in self.local_parameters().items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[k] = runtime.unshard_tensor(g, self._placement[k], self.groups)
        return out

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """FQN -> the full parameter, gathered (a collective)."""
        return {k: runtime.unshard_tensor(p, self._placement[k], self.groups)
                for k, p in self.local_parameters().items()}

    def dump_passes(self, directory: str) -> list[str]:
        """A table (and DOT) of the graph after each pass: ``NN_<pass>.txt``."""
        os.makedirs(directory, exist_ok=True)
        paths = []
        for i, (name, text, dot) in enumerate(self._snapshots):
            base = os.path.join(directory, f"{i:02d}_{name}")
            with open(base + ".txt", "w") as f:
                f.write(text)
            with open(base + ".dot", "w") as f:
                f.write(dot)
            paths += [base + ".txt", base + ".dot"]
        return paths


def compile(model: nn.Module, mesh, example_inputs, *, plan: Plan | None = None, hints=None,
            cluster: str = "cpu-local", budget_gib: float | None = None, temporal: bool = True,
            backend: str | None = None) -> DistributedModel:
    """Compile ``model`` for ``mesh`` (a DeviceMesh, or a shape such as ``(2, 2)`` / ``"4"``)
    on every rank; see the module docstring. ``plan`` skips the search (every rank must
    pass the same one: the ranks check it before running)."""
    if not dist.is_initialized():
        raise RuntimeError("stpc.compile: torch.distributed is not initialised; call "
                           "dist.init_process_group (or run under torchrun / stpc.runtime.launch.spawn)")
    tg = trace(model, tuple(example_inputs))
    if plan is None:
        if isinstance(mesh, DeviceMesh):
            spec = tuple(mesh.shape) if mesh.ndim > 1 else mesh.size()
        else:
            spec = mesh
        budget = None if budget_gib is None else budget_gib * 2**30
        plan = search(tg, spec, cluster=cluster, budget_bytes=budget, hints=hints, temporal=temporal)
    dm = make_mesh(mesh if isinstance(mesh, DeviceMesh) else None, plan.mesh_shape)
    runtime.check_plan_agreement(plan.hash())
    # every rank cuts its shards from its own full copy: the copies must be one model
    runtime.check_tensors_agree({**dict(model.named_parameters()), **dict(model.named_buffers())},
                                what="weights")
    groups = runtime.axis_groups(dm)
    snapshots = []

    def snap(name, gm):
        view = plan if name == "traced" else _Placements(gm)
        snapshots.append((name, _table(gm, view), _dot(gm, view)))

    gm = run_passes(tg.gm, plan, groups, mesh_device(dm), on_pass=snap)
    specs = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (None, type(x).__name__)
             for x in example_inputs]
    return DistributedModel(gm, plan, dm, groups, tg, model, snapshots, backend=backend, input_specs=specs)
