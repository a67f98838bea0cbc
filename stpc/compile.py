"""stpc.compile: the one place that strings the stages together.

    pm = stpc.compile(model, mesh, example_inputs)     # on every rank (under torchrun)
    opt = torch.optim.AdamW(pm.parameters())           # DTensor parameters
    loss = pm(idx, targets); loss.backward(); opt.step()

trace (frontend, on a meta view of the model: nothing allocated) -> analyse + search
(planner, unless a Plan is given) -> rank agreement on the plan and the weights
(runtime) -> passes (shard_params, insert_collectives, ring_decompose, cleanup, verify)
-> optional torch.compile of the resulting GraphModule -> the model itself, its class
``STPC<Class>`` and its parameters DTensors (``stpc.module``). A later call with inputs
of another shape comes back here to plan that shape too (``Compiled.run``).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import itertools
import json
import math
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from stpc import frontend, passes, runtime, validate
from stpc.cost_models import GRAD_BUCKET_BYTES, OPTIMIZER_IMPLS
from stpc.planner import report
from stpc.frontend.dump import dot as _dot
from stpc.frontend.dump import table as _table
from stpc.module import Compiled, DistributedModel, Program, adopt, flatten_call, full_meta_view, mesh_device
from stpc.placement import fmt
from stpc.planner import Hints, Plan, analyse, preset, search
from stpc.planner.cache import PlanCache, graph_digest, plan_key
from stpc.planner.summary import breakdown
from stpc.runtime.dtensors import grid_axes, storage_mesh, tokens_of
from stpc.validate import InvalidArgument, NotPlanned, PlanWarning

__all__ = ["compile", "trace", "DistributedModel", "run_passes", "make_mesh"]


def trace(model: nn.Module, example_inputs: tuple = (), name: str = "",
          example_kwargs: dict | None = None) -> frontend.TracedGraph:
    """Trace ``model`` to an annotated aten graph (``stpc.frontend.trace``) and analyse it
    for the planner (``stpc.planner.analyse``: mesh-independent, done once and reused by
    every mesh shape and search). Works on ``meta`` tensors: nothing is allocated."""
    tg = frontend.trace(model, tuple(example_inputs), name, example_kwargs)
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
               on_pass=None, replicate_outputs: bool = True, defer_grads: bool = False,
               read_at_use: bool = False) -> fx.GraphModule:
    """shard_params -> insert_collectives -> ring_decompose -> cleanup -> (defer_grad_sync) ->
    recompute -> prefetch_params -> issue_early -> verify (-> read_params_at_use), for a program whose tensors live on ``device``. ``on_pass(name, gm)`` is called
    after each (e.g. to dump the graph). ``replicate_outputs=False`` leaves outputs as
    planned (split ones stay split) where DTensor can say the placement; ``defer_grads``
    hands data-parallel gradient reductions to a bucketed reducer (the caller installs it:
    ``gm.meta["stpc_deferred_grads"]`` says for what); ``read_at_use``: the program is run
    eagerly, given the parameters themselves, and reads each where it first uses it."""
    if on_pass:
        on_pass("traced", gm)
    gm = passes.shard_params(gm, plan, groups=groups, device=device)
    if on_pass:
        on_pass("shard_params", gm)
    gm = passes.insert_collectives(gm, plan, replicate_outputs=replicate_outputs)
    if on_pass:
        on_pass("insert_collectives", gm)
    for name in ("ring_decompose", "cleanup") + (("defer_grad_sync",) if defer_grads else ()) + (
            "recompute", "prefetch_params", "issue_early", "verify") + (("read_params_at_use",) if read_at_use else ()):
        gm = getattr(passes, name)(gm, plan)
        if on_pass:
            on_pass(name, gm)
    return gm


def group_options(device_type: str, timeout_s: float | None):
    """``(backend, options)`` that give the process groups stpc creates a timeout of
    ``timeout_s`` seconds (None: the backend's default)."""
    if timeout_s is None:
        return None
    if device_type == "cuda":
        backend, opts = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, opts = "gloo", (getattr(dist.ProcessGroupGloo, "_Options", None) or dist.ProcessGroupGloo.Options)()
    opts._timeout = datetime.timedelta(seconds=float(timeout_s))
    return backend, opts


def make_mesh(mesh, plan_shape, timeout_s: float | None = None):
    """A DeviceMesh of ``plan_shape`` over the ranks of ``mesh`` (a DeviceMesh, whose ranks
    are viewed row-major in the plan's shape, or None for all ranks on the world's device
    type). Groups made here time out after ``timeout_s`` (a DeviceMesh given in the plan's
    shape is used as it is, with its own groups' timeouts)."""
    plan_shape = tuple(int(n) for n in plan_shape)
    device_type = mesh.device_type if isinstance(mesh, DeviceMesh) else validate.world_device_type()
    override = group_options(device_type, timeout_s)
    if mesh is None or not isinstance(mesh, DeviceMesh):
        if math.prod(plan_shape) != dist.get_world_size():
            raise ValueError(f"the plan's mesh {plan_shape} needs {math.prod(plan_shape)} ranks; "
                             f"the world has {dist.get_world_size()}")
        if override is None:
            return init_device_mesh(device_type, plan_shape)
        return init_device_mesh(device_type, plan_shape, backend_override={a: override for a in range(len(plan_shape))})
    if tuple(mesh.shape) == plan_shape:
        return mesh
    if mesh.size() != math.prod(plan_shape):
        raise ValueError(f"the plan's mesh {plan_shape} does not fit the DeviceMesh of shape "
                         f"{tuple(mesh.shape)}; re-plan for {mesh.size()} devices")
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(plan_shape),
                      backend_override=None if override is None else (override,) * len(plan_shape))


@dataclasses.dataclass
class _Options:
    """What compile was asked, kept for planning later input shapes the same way."""

    hints: object
    cluster: object             # a preset name, a profile path or a Cluster
    budget: float | None        # bytes
    temporal: bool
    backend: str | None
    outputs: str
    local_inputs: dict          # user-input placeholder -> placement the caller feeds its shard in
    cache: PlanCache | None     # where searched plans are kept (None: search every time)
    strict: bool = False        # what is not planned is an error, not a warning
    bucket_mb: float | None = GRAD_BUCKET_BYTES / 2**20  # data-parallel gradient buckets (None: reduce at each use)
    timeout_s: float | None = None  # of the process groups stpc makes
    optimizer_impl: str = "foreach"  # the AdamW implementation plans are costed for


def _meta(x, placement=None, mesh_shape=()):
    """A meta stand-in of a call's leaf with its *global* shape (a caller-sharded leaf is
    scaled back up by its placement's splits)."""
    if isinstance(x, DTensor):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor):
        shape = list(x.shape)
        if placement is not None:
            for tok, n in zip(placement, mesh_shape):
                if tok[0] == "S":
                    shape[int(tok[1:])] *= n
        return torch.empty(shape, dtype=x.dtype, device="meta")
    return x


def _trace_call(model, args, kwargs, local_leaves: dict, mesh_shape) -> frontend.TracedGraph:
    flat, spec = flatten_call(args, kwargs)
    flat = [_meta(x, local_leaves.get(i), mesh_shape) for i, x in enumerate(flat)]
    margs, mkwargs = pytree.tree_unflatten(flat, spec)
    with full_meta_view(model) as view:
        return trace(view, margs, type(view).__name__, mkwargs)


def _hints_for(opts: _Options, mesh_shape, param_exact: dict, input_exact: dict) -> Hints:
    h = opts.hints
    if isinstance(h, str):
        h = preset(h, tuple(mesh_shape))
    h = h or Hints()
    return dataclasses.replace(h, param_exact={**h.param_exact, **param_exact},
                               input_exact={**h.input_exact, **input_exact})


def _program(tg, plan: Plan, mesh: DeviceMesh, groups, opts: _Options) -> Program:
    """Run the passes for ``plan`` and describe what each placeholder of the result receives."""
    snapshots = []

    def snap(name, gm):
        view = plan if name == "traced" else _Placements(gm)
        snapshots.append((name, _table(gm, view), _dot(gm, view)))

    # the passes give nodes their local values in place; the plan's solved problem
    # (plan.summary(), breakdown) reads the traced graph again: lower a copy of it
    traced = fx.GraphModule(tg.gm, copy.deepcopy(tg.gm.graph))
    traced.meta.update(tg.gm.meta)
    traced.meta["stpc_tied_params"] = dict(tg.tied_params)
    timeout = None if opts.timeout_s is None else datetime.timedelta(seconds=float(opts.timeout_s))
    traced.meta["stpc_joint_groups"] = _joint_groups(mesh, timeout)
    gm = run_passes(traced, plan, groups, mesh_device(mesh), on_pass=snap,
                    replicate_outputs=opts.outputs == "replicate", defer_grads=opts.bucket_mb is not None,
                    read_at_use=opts.backend is None)
    leaf_of = {name: i for i, name in enumerate(tg.user_inputs)}
    feed = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        placement = tuple(node.meta.get("placement", ("R",) * len(plan.mesh_shape)))
        if node.name in tg.param_fqns:
            feed.append(("param_ref" if node.meta.get("read_at_use") else "param", tg.param_fqns[node.name], placement))
        elif node.name in tg.buffer_fqns:
            feed.append(("buffer", tg.buffer_fqns[node.name], placement))
        elif isinstance(node.meta.get("val"), torch.Tensor):
            feed.append(("input", leaf_of[node.name], placement, node.name in opts.local_inputs))
        else:
            feed.append(("const", leaf_of[node.name]))
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    outs = pytree.tree_leaves(out_node.args[0])
    out_placements = [tuple(o.meta["placement"]) if isinstance(o, fx.Node) and "placement" in o.meta else None
                      for o in outs]
    out_shapes = [tuple(o.meta["global_val"].shape) if isinstance(o, fx.Node) and "global_val" in o.meta
                  else None for o in outs]
    fn = torch.compile(gm, backend=opts.backend) if opts.backend else gm
    # a gradient summed over several axes is summed once, over their joint group
    deferred = {tg.param_fqns[ph]: runtime.joint_group(mesh, tuple(groups.index(g) for g in names), timeout)
                for ph, names in gm.meta.get("stpc_deferred_grads", {}).items()}
    return Program(plan, gm, fn, feed, tg.in_spec, tg.out_spec, out_placements, out_shapes, snapshots,
                   deferred=deferred, bucket_bytes=int((opts.bucket_mb or 0) * 2**20),
                   keep_buckets=bool(plan.stats.get("keep_grad_buckets", False)),
                   calls=list(tg.meta.get("module_calls", [])), backend=opts.backend,
                   # ZeRO-3 regathers in backward; on a ZeRO-2 axis what forward gathered is kept
                   regathers=_regathered_groups(gm, plan, groups) if opts.backend is None else frozenset())


def _joint_groups(mesh: DeviceMesh, timeout) -> dict[tuple, str]:
    """The process group of every set of two or more mesh axes (of more than one device
    each) taken together, made on every rank alike before the passes run: what
    ``prefetch_params`` gathers a parameter split over several axes on in one collective."""
    axes = [a for a in range(mesh.ndim) if mesh.size(a) > 1]
    return {combo: runtime.joint_group(mesh, combo, timeout)
            for k in range(2, len(axes) + 1) for combo in itertools.combinations(axes, k)}


def _regathered_groups(gm: fx.GraphModule, plan: Plan, groups: list[str]) -> frozenset:
    """The process groups whose coalesced parameter gathers backward makes again: every one
    a ``gather_wait`` runs on, less those of the mesh axes the plan keeps gathered weights
    over (``plan.stats["keep_gathered"]``: a list of axes; ``True``, written by older
    versions, is every axis) and the joint groups that include one of them."""
    kept = plan.stats.get("keep_gathered") or []
    if kept is True:
        kept = range(len(plan.mesh_shape))
    kept_groups = {groups[a] for a in kept}
    kept_groups |= {name for axes, name in gm.meta.get("stpc_joint_groups", {}).items() if set(axes) & set(kept)}
    return frozenset(n.args[3] for n in gm.graph.nodes
                     if n.target is runtime.gather_wait and n.args[3] not in kept_groups)


def _report(plan: Plan, tg, opts: _Options) -> None:
    """Warn (raise under ``strict``) about what the plan leaves out; note indivisible dims."""
    hints = preset(opts.hints, tuple(plan.mesh_shape)) if isinstance(opts.hints, str) else opts.hints
    problems = []
    by_op: dict[str, list] = {}
    for node, op, src in report.fallbacks(plan, tg):
        by_op.setdefault(op, []).append(f"{node}" + (f" at {src}" if src else ""))
    for op, where in by_op.items():
        more = f" and {len(where) - 3} more" if len(where) > 3 else ""
        problems.append(f"{op} has no sharding rule: {len(where)} node(s) run replicated on every rank "
                        f"({'; '.join(where[:3])}{more})")
    problems += [f"hint {m}" for m in report.hint_misses(hints, tg, plan.mesh_shape)]
    for msg in problems:
        if opts.strict:
            raise NotPlanned(f"stpc.compile (strict): {msg}. Fix: rewrite that part of the model with ops stpc "
                             f"plans, or fix the hint; strict=False runs it with a warning")
        warnings.warn(f"stpc: {msg}", PlanWarning, stacklevel=3)
    plan.stats["indivisible"] = report.indivisible(tg, plan.mesh_shape)


def _check_schedules(prog: Program, mesh: DeviceMesh) -> None:
    """Every rank derives from its own program the communication each rank will issue and
    checks, with one all-gather, that each rank's own sequence is the one it expects
    (``runtime.check_schedule_agreement``): a mismatch fails on every rank before any step."""
    order = mesh.mesh.flatten().tolist()  # mesh position -> world rank (a DeviceMesh may permute them)
    digest = [hashlib.sha256(json.dumps(passes.comm_schedule(prog.gm, prog.plan, i), sort_keys=True,
                                        default=str).encode()).hexdigest() for i in range(len(order))]
    expected = [digest[order.index(w)] for w in range(dist.get_world_size())]
    runtime.check_schedule_agreement(expected[dist.get_rank()], expected)


def _plan_once(tg, mesh_spec, opts: _Options, param_exact: dict, input_exact: dict) -> Plan:
    """Rank 0 plans (searches, or reads the plan cache); every other rank takes its plan.
    Each rank searching for itself would search the same problem once per rank, on cores
    ranks often share, and a search that CP-SAT's wall-clock limit cuts short under that
    contention could end differently on two ranks. First the ranks check that they traced
    the same program: a rank with other example input shapes would run a plan made for
    rank 0's. (Rank 0's plan keeps the problem it was solved from, ``plan.solved``; the
    others' are read from its JSON, as a cached plan is.)"""
    runtime.check_traced_agreement(f"{graph_digest(tg)}:{mesh_spec!r}")
    mine = []  # (rank 0's plan object)

    def plan_here() -> str:
        mine.append(_plan(tg, mesh_spec, opts, param_exact, input_exact))
        breakdown(mine[0])  # (kept in its stats: the others' summaries split the step too)
        return mine[0].to_json()

    text = runtime.from_rank0(plan_here)
    return mine[0] if mine else Plan.from_json(text)


def _plan(tg, mesh_spec, opts: _Options, param_exact: dict, input_exact: dict) -> Plan:
    """Search (or read from the plan cache) the plan of ``tg`` on ``mesh_spec``."""
    shape = mesh_spec if isinstance(mesh_spec, tuple) else None
    if isinstance(opts.hints, str) and shape is None:
        hints = opts.hints  # a preset: the search instantiates it per mesh shape
        if param_exact or input_exact:
            raise ValueError("pinned placements need a fixed mesh shape")
    else:
        hints = _hints_for(opts, shape, param_exact, input_exact) if shape else opts.hints
    budget = opts.budget
    # (the buckets the runtime will sum data-parallel gradients in: what their sums are costed as)
    buckets = None if opts.bucket_mb is None else opts.bucket_mb * 2**20
    key = (plan_key(tg, mesh_spec, opts.cluster, budget, hints, opts.temporal, optimizer_impl=opts.optimizer_impl,
                    grad_bucket_bytes=buckets)
           if opts.cache is not None else None)
    if key is not None and (plan := opts.cache.get(key)) is not None:
        plan.stats["cache"] = str(opts.cache.path(key))
        return plan
    plan = search(tg, mesh_spec, cluster=opts.cluster, budget_bytes=budget, hints=hints, temporal=opts.temporal,
                  optimizer_impl=opts.optimizer_impl, grad_bucket_bytes=buckets)
    if key is not None:
        opts.cache.put(key, plan)
    return plan


def compile(model: nn.Module, mesh=None, example_inputs=(), example_kwargs: dict | None = None, *,
            plan: Plan | None = None, hints=None, cluster=None, budget_gib: float | None = None,
            temporal: bool = True, backend: str | None = None, input_placements=None,
            outputs: str = "replicate", max_plans: int = 4, cache=True, strict: bool = False,
            timeout_s: float | None = None, bucket_mb: float | None = GRAD_BUCKET_BYTES / 2**20,
            optimizer_impl: str = "foreach") -> DistributedModel:
    """Compile ``model`` for ``mesh`` on every rank and return it, parallelised in place.

    ``mesh``: a DeviceMesh, a shape such as ``(2, 2)`` / ``"2x2"``, or a device count
    (``4``, ``"4"``; None: the world size) for the planner to choose the shape.
    ``cluster``: what plans are costed on (a preset, a profile path, a Cluster; None: this
    world's, see ``stpc.cost_models.world_cluster``). Everything is validated before any
    tracing: :class:`stpc.validate.InvalidArgument` names the cause and the fix.
    ``example_inputs`` / ``example_kwargs``: one call's positional and keyword inputs
    (full, global tensors; a plan is made for their shapes). ``plan`` skips the search
    (every rank must pass the same one: the ranks check it); without one, rank 0 searches
    and every rank runs its plan. ``hints``: ``"megatron"``,
    ``"dp"`` or a :class:`stpc.planner.Hints`. ``backend``: hand the program to
    ``torch.compile`` (``"inductor"``, ``"aot_eager"``). ``input_placements``: user inputs
    the caller feeds as this rank's shard, ``{name: placements}`` (DTensor placements or
    tokens on the plan's mesh; names are the forward's argument names); by default every
    rank passes the full input and keeps its own slice. ``outputs``: ``"replicate"``
    (every rank gets the full outputs) or ``"sharded"`` (split outputs come back as
    DTensors as planned). ``max_plans``: how many input signatures may be planned before
    a call with yet another one raises :class:`stpc.module.ShapeMismatch`. ``cache``: searched
    plans are kept on disk and reused (``True``: ``stpc.planner.cache.default_dir()``; a path;
    ``False``: search every time). ``strict``: an op without a sharding rule (planned
    replicated) or a hint that has no effect raises :class:`stpc.validate.NotPlanned`
    instead of a :class:`stpc.validate.PlanWarning`. ``timeout_s``: the process groups stpc
    creates for the mesh time out after that many seconds (None: the backend's default), so
    a rank that dies or stalls makes the others raise :class:`stpc.runtime.CommFailure`
    naming the operation instead of hanging. ``budget_gib``: the per-device memory a plan
    may fill (None: the cluster's device memory times its usable fraction, 0.8 by default,
    ``stpc.cost_models.USABLE_MEMORY_FRACTION``). ``bucket_mb``: gradients of parameters
    replicated over a data-parallel axis are summed in buckets of that many MiB, launched
    asynchronously as backward produces them (as DDP does); None: each is all-reduced
    where it is used, synchronously; the plan is searched for the one given
    (``MemoryModel.grad_bucket_bytes``; a ``plan`` passed in keeps what it was costed
    with, ``plan.stats["grad_bucket_bytes"]``). ``optimizer_impl``: the AdamW implementation the
    trainer will step the parameters with, whose step time and scratch memory every plan is
    charged: ``"foreach"`` (``AdamW(foreach=True)``, torch's default on CUDA), ``"fused"``
    (``AdamW(fused=True)``: one pass, no scratch; TorchTitan's default) or ``"single"`` (the
    per-tensor loop, torch's default on CPU).

    The returned model is ``model`` itself (its class becomes ``STPC<Class>``; its
    parameters DTensors of this rank's shards, buffers on the mesh's device); ``model.stpc``
    holds the plan and the programs.
    """
    if not dist.is_initialized():
        raise RuntimeError("stpc.compile: torch.distributed is not initialised; call "
                           "dist.init_process_group (or run under torchrun / stpc.runtime.launch.spawn)")
    if isinstance(model, DistributedModel):
        raise TypeError(f"stpc.compile: {type(model).__name__} is compiled already; compile the model "
                        f"as it was built")
    # everything is checked before any work: one error naming the cause and the fix
    world, device_type = dist.get_world_size(), validate.world_device_type()
    if outputs not in ("replicate", "sharded"):
        raise InvalidArgument(f"stpc.compile: outputs={outputs!r} is not an output mode. Fix: outputs='replicate' "
                              f"(full outputs on every rank) or 'sharded' (split ones as DTensors)")
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise InvalidArgument(f"stpc.compile: max_plans={max_plans!r} is not a whole number >= 1. Fix: max_plans=1 "
                              f"to refuse other input shapes, more to plan them too")
    mesh_spec = validate.mesh_spec(mesh, plan, world, device_type)
    example_kwargs = dict(example_kwargs or {})
    example_inputs = validate.example_inputs(model, example_inputs, example_kwargs, device_type)
    hints = validate.hints(hints)
    backend = validate.backend(backend)
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise InvalidArgument(f"stpc.compile: timeout_s={timeout_s!r} is not a positive number of seconds. Fix: "
                              f"e.g. timeout_s=600, or None for the backend's default")
    cluster = validate.cluster(cluster, world, device_type)
    budget = validate.budget(budget_gib, cluster)
    local = {}
    if input_placements:
        if not isinstance(mesh_spec, tuple):
            raise InvalidArgument("stpc.compile: input_placements need a fixed mesh shape (a DeviceMesh, or a shape "
                                  "such as (2, 2)), so the placements name its axes")
        try:
            local = {k: tokens_of(v, len(mesh_spec)) for k, v in dict(input_placements).items()}
        except ValueError as e:
            raise InvalidArgument(f"stpc.compile: input_placements: {e}. Fix: one Shard(d) or Replicate() per "
                                  f"mesh axis of {mesh_spec}") from None
    if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
                                  or not bucket_mb > 0):
        raise InvalidArgument(f"stpc.compile: bucket_mb={bucket_mb!r} is not a positive number of MiB. Fix: e.g. "
                              f"bucket_mb=25 (DDP's default), or None to reduce each gradient where it is used")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise InvalidArgument(f"stpc.compile: optimizer_impl={optimizer_impl!r} is not an AdamW implementation. Fix: "
                              f"one of {', '.join(map(repr, OPTIMIZER_IMPLS))}, the one the trainer builds its "
                              f"AdamW with ('fused' for AdamW(fused=True))")
    store = None if cache is False else PlanCache(None if cache is True else cache)
    opts = _Options(hints, cluster, budget, temporal, backend, outputs, local, store, strict,
                    None if bucket_mb is None else float(bucket_mb), timeout_s, optimizer_impl)

    tg = _trace_call(model, example_inputs, example_kwargs, {}, mesh_spec)
    unknown = set(local) - set(tg.user_inputs)
    if unknown:
        raise InvalidArgument(f"stpc.compile: input_placements name {sorted(unknown)}, which are not inputs of "
                         f"{type(model).__name__}.forward; its tensor inputs are {tg.user_inputs}")
    if plan is None:
        plan = _plan_once(tg, mesh_spec, opts, {}, local)
    _report(plan, tg, opts)
    dm = make_mesh(mesh if isinstance(mesh, DeviceMesh) else None, plan.mesh_shape, timeout_s)
    runtime.check_plan_agreement(plan.hash())
    # every rank cuts its shards from its own full copy: the copies must be one model
    runtime.check_tensors_agree({**dict(model.named_parameters()), **dict(model.named_buffers())},
                                what="weights")
    groups = runtime.axis_groups(dm)
    prog = _program(tg, plan, dm, groups, opts)
    _check_schedules(prog, dm)

    fqn_place = {}
    for kind, *rest in prog.feed:
        if kind in ("param", "param_ref"):
            fqn_place[rest[0]] = rest[1]
    canon = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        canon.setdefault(id(p), fqn)
    names = dict(model.named_parameters(remove_duplicate=False))
    stored_for = {}
    for fqn, placement in fqn_place.items():
        key = canon[id(names[fqn])]
        if key in stored_for and stored_for[key] != placement:
            raise NotImplementedError(
                f"stpc.compile: parameter {key} is read through two placeholders with different placements "
                f"{fmt(stored_for[key])} and {fmt(placement)}; force one placement for it with Hints.param_force")
        stored_for[key] = placement
    grids = grid_axes(stored_for.values())
    timeout = None if timeout_s is None else datetime.timedelta(seconds=float(timeout_s))
    all_exact = {fqn: stored_for[canon[id(p)]] for fqn, p in names.items() if canon[id(p)] in stored_for}
    leaf_of = {name: i for i, name in enumerate(tg.user_inputs)}
    local_leaves = {leaf_of[k]: v for k, v in local.items()}

    def make_program(module, args, kwargs, first: Program) -> Program:
        tg2 = _trace_call(module, args, kwargs, local_leaves, tuple(plan.mesh_shape))
        plan2 = _plan_once(tg2, tuple(plan.mesh_shape), opts, all_exact, local)
        _report(plan2, tg2, opts)
        runtime.check_plan_agreement(plan2.hash())
        prog2 = _program(tg2, plan2, dm, groups, opts)
        _check_schedules(prog2, dm)
        return prog2

    compiled = Compiled(mesh=dm, storage=storage_mesh(dm, grids, group_options(dm.device_type, timeout_s)),
                        grids=grids, groups=groups,
                        param_placements=stored_for, orig_class=type(model), make_program=make_program,
                        max_plans=max_plans, local_leaves=local_leaves,
                        check_group=runtime.resolve_group(runtime.joint_group(dm, tuple(range(dm.ndim)), timeout)))
    flat, spec = flatten_call(example_inputs, example_kwargs)
    compiled.add(compiled.signature(flat, spec, model.training, example=True), prog)
    return adopt(model, compiled)
