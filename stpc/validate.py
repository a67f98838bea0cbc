"""validate: what ``stpc.compile`` is given is checked before any tracing or planning.

Each problem is one :class:`InvalidArgument` naming the cause and the fix, raised on
every rank alike (the checks read only what every rank was given and the world's size
and backend), so no rank traces, searches or communicates for a job that cannot run.
The default cluster follows the world the job runs in (``world_cluster``).
"""
from __future__ import annotations

import inspect
import math
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh

from stpc.cost_models import CLUSTERS, Cluster, default_profile_path, get_cluster, world_cluster
from stpc.planner.hints import PRESETS, Hints

__all__ = ["InvalidArgument", "NotPlanned", "PlanWarning", "mesh_spec", "example_inputs", "budget", "cluster",
           "world_device_type", "hints", "backend"]

_SPEC = re.compile(r"^\s*\d+\s*(x\s*\d+\s*)*$", re.IGNORECASE)


class InvalidArgument(ValueError):
    """``stpc.compile`` was given something it cannot run with (raised before any work)."""


class PlanWarning(UserWarning):
    """Part of the model was not planned as asked: an op without a sharding rule runs
    replicated, a hint had no effect."""


class NotPlanned(InvalidArgument):
    """With ``strict=True``: what would otherwise be a :class:`PlanWarning`."""


def world_device_type() -> str:
    """The device type of this world's ranks, from the backend the world was initialised
    with: ``"cuda"`` under ``"nccl"``, or under a per-device string that gives CUDA a
    backend (``"cpu:gloo,cuda:nccl"``) where CUDA is available; ``"cpu"`` otherwise
    (``"gloo"``, ``"cpu:gloo"``). A world initialised without a backend has torch's
    default for this machine (``dist.get_backend_config()``: CUDA's NCCL where there is a GPU)."""
    name = str(dist.get_backend())
    if name == "undefined":
        name = str(dist.get_backend_config())
    if ":" not in name:  # one backend for every device
        return "cuda" if name == "nccl" else "cpu"
    devices = {pair.split(":", 1)[0].strip() for pair in name.split(",") if ":" in pair}
    return "cuda" if "cuda" in devices and torch.cuda.is_available() else "cpu"


def mesh_spec(mesh, plan, world: int, device_type: str):
    """The mesh as the search takes it (a shape tuple, or a device count to choose a shape
    for), after checking it describes ``world`` devices of ``device_type``."""
    fix = "pass a device count (4, '4'), a shape ((2, 2), '2x2') or a DeviceMesh over all ranks"
    if isinstance(mesh, DeviceMesh):
        if mesh.device_type != device_type:
            raise InvalidArgument(f"stpc.compile: the DeviceMesh is on {mesh.device_type!r} but this world's backend "
                                  f"({dist.get_backend()}) runs on {device_type!r}. Fix: build the mesh with "
                                  f"init_device_mesh({device_type!r}, ...)")
        spec = tuple(int(n) for n in mesh.shape)
    elif mesh is None:
        spec = world
    elif isinstance(mesh, bool) or not isinstance(mesh, (int, str, tuple, list)):
        raise InvalidArgument(f"stpc.compile: mesh {mesh!r} ({type(mesh).__name__}) is not a mesh. Fix: {fix}")
    elif isinstance(mesh, str):
        if not _SPEC.match(mesh):
            raise InvalidArgument(f"stpc.compile: mesh {mesh!r} is not a mesh spec. Fix: {fix}")
        parts = tuple(int(x) for x in mesh.lower().split("x"))
        spec = parts if len(parts) > 1 else parts[0]
    elif isinstance(mesh, int):
        spec = mesh
    else:
        if not mesh or any(isinstance(n, bool) or not isinstance(n, int) for n in mesh):
            raise InvalidArgument(f"stpc.compile: mesh {mesh!r} is not a shape of whole numbers. Fix: {fix}")
        spec = tuple(mesh)
    sizes = spec if isinstance(spec, tuple) else (spec,)
    if any(n < 1 for n in sizes):
        raise InvalidArgument(f"stpc.compile: mesh {mesh!r} has an axis of size < 1. Fix: {fix}")
    n = math.prod(sizes)
    if n != world:
        raise InvalidArgument(f"stpc.compile: mesh {mesh!r} has {n} devices but this job has {world} ranks. Fix: "
                              f"launch {n} ranks (torchrun --nproc_per_node {n}) or pass a mesh of {world} devices")
    if plan is not None:
        shape = tuple(int(x) for x in plan.mesh_shape)
        if math.prod(shape) != world:
            raise InvalidArgument(f"stpc.compile: the plan is for mesh {shape} ({math.prod(shape)} devices) but this "
                                  f"job has {world} ranks. Fix: re-plan for {world} devices, or launch "
                                  f"{math.prod(shape)} ranks")
        if isinstance(spec, tuple) and not isinstance(mesh, DeviceMesh) and spec != shape:
            raise InvalidArgument(f"stpc.compile: the plan is for mesh {shape}, the mesh given is {spec}. Fix: "
                                  f"pass mesh={shape} (or no mesh) with this plan")
        return shape
    return spec


def example_inputs(model: nn.Module, args, kwargs: dict, device_type: str) -> tuple:
    """The positional example inputs as a tuple, after checking that they fit ``model``'s
    forward (count and names), live on the CPU, ``meta`` or the mesh's device, and that
    floating-point ones have a dtype of the model's parameters."""
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise InvalidArgument(f"stpc.compile: example_inputs must be a tuple of {type(model).__name__}.forward's "
                              f"positional arguments, got {type(args).__name__}. Fix: pass (x,) for one input")
    args = tuple(args)
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            raise InvalidArgument(f"stpc.compile: the example inputs do not fit {type(model).__name__}.forward"
                                  f"{sig}: {e}. Fix: give example_inputs / example_kwargs as you would call "
                                  f"the model") from None
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    names = list(sig.parameters) if sig is not None else []
    for path, x in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(x, torch.Tensor):
            continue
        where = _name(path, names)
        if x.device.type not in ("cpu", "meta", device_type):
            raise InvalidArgument(f"stpc.compile: example input {where} is on {x.device} but the mesh runs on "
                                  f"{device_type!r}. Fix: move it to the CPU or to {device_type!r}")
        if x.is_floating_point() and floats and x.dtype not in floats:
            raise InvalidArgument(f"stpc.compile: example input {where} is {x.dtype} but the model's parameters are "
                                  f"{', '.join(sorted(map(str, floats)))}. Fix: cast the input (or the model) so "
                                  f"they match")
    return args


def _name(path, names) -> str:
    """``idx`` / ``kwargs['labels']`` for a leaf's pytree path in ``(args, kwargs)``."""
    keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
    if keys and keys[0] == 0 and len(keys) > 1 and isinstance(keys[1], int) and keys[1] < len(names):
        return repr(names[keys[1]]) + "".join(f"[{k!r}]" for k in keys[2:])
    if keys and keys[0] == 1 and len(keys) > 1:
        return repr(keys[1]) + "".join(f"[{k!r}]" for k in keys[2:])
    return str(keys)


def budget(budget_gib, cluster) -> float:
    """The per-device memory budget in bytes; None: ``cluster``'s default budget (its device
    memory less the allocator's headroom, ``Cluster.default_budget_bytes``)."""
    if budget_gib is None:
        return (cluster if isinstance(cluster, Cluster) else get_cluster(cluster)).default_budget_bytes
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not math.isfinite(budget_gib) \
            or budget_gib <= 0:
        raise InvalidArgument(f"stpc.compile: budget_gib={budget_gib!r} is not a positive number of GiB. Fix: pass "
                              f"e.g. budget_gib=70, or None for the device's memory less the allocator's headroom")
    return float(budget_gib) * 2**30


def cluster(name_or_cluster, world: int, device_type: str) -> str | Cluster:
    """The cluster to cost plans on: the one named (a preset, a profile path, a Cluster), or
    by default the world's (:func:`stpc.cost_models.world_cluster`)."""
    if name_or_cluster is None:
        name = torch.cuda.get_device_name() if device_type == "cuda" else ""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (torch.cuda.device_count() if device_type == "cuda"
                                                                else world)
        try:
            return world_cluster(world, device_type, name, local)
        except ValueError as e:
            raise InvalidArgument(f"stpc.compile: {str(e).split('; ')[0]}. Fix: pass cluster= a preset "
                                  f"({', '.join(CLUSTERS)}), or (re)write this machine's profile "
                                  f"{default_profile_path()} with `python -m stpc calibrate`") from None
    if isinstance(name_or_cluster, Cluster):
        got = name_or_cluster
    else:
        try:
            got = get_cluster(str(name_or_cluster))
        except (KeyError, FileNotFoundError, ValueError) as e:
            raise InvalidArgument(f"stpc.compile: cluster {name_or_cluster!r}: {str(e).strip(chr(39))}. Fix: "
                                  f"cluster=None (the world's), a preset ({', '.join(CLUSTERS)}) or a profile "
                                  f"from `python -m stpc calibrate`") from None
    if got.num_devices < world:
        raise InvalidArgument(f"stpc.compile: cluster {got.name!r} has {got.num_devices} devices but this job has "
                              f"{world} ranks. Fix: cluster=None (it follows the world) or a cluster of at least "
                              f"{world} devices")
    return name_or_cluster


def hints(h):
    """The hints, after checking they are hints: None, a preset's name or a :class:`Hints`."""
    if h is None or isinstance(h, Hints):
        return h
    if isinstance(h, str):
        if h not in PRESETS:
            raise InvalidArgument(f"stpc.compile: hints={h!r} is not a hints preset. Fix: hints= one of "
                                  f"{', '.join(map(repr, PRESETS))}, a stpc.planner.Hints, or None (no hints)")
        return h
    raise InvalidArgument(f"stpc.compile: hints={h!r} ({type(h).__name__}) are not hints. Fix: pass a "
                          f"stpc.planner.Hints (e.g. Hints(param_exact={{'wte.weight': ('S0',)}})), a preset "
                          f"({', '.join(map(repr, PRESETS))}) or None")


def backend(b):
    """The ``torch.compile`` backend, after checking it is one: None (no torch.compile), a
    registered backend's name or a callable backend."""
    if b is None or (callable(b) and not isinstance(b, str)):
        return b
    if isinstance(b, str) and b:
        from torch._dynamo import list_backends  # lazy: ~0.3 s to import, only a backend name needs it

        known = list_backends(exclude_tags=())
        if b in known:
            return b
        raise InvalidArgument(f"stpc.compile: backend={b!r} is not a torch.compile backend. Fix: backend="
                              f"'inductor', 'aot_eager' or 'eager' (registered here: {', '.join(sorted(known))}), a "
                              f"callable backend, or None to run without torch.compile")
    raise InvalidArgument(f"stpc.compile: backend={b!r} ({type(b).__name__}) is not a torch.compile backend. Fix: "
                          f"backend='inductor' (or another name from torch._dynamo.list_backends()), a callable "
                          f"backend, or None to run without torch.compile")
