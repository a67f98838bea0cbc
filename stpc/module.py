"""The compiled model: the user's own ``nn.Module``, its parameters DTensors, its forward
the SPMD program.

``stpc.compile(model, ...)`` returns ``model`` itself, as FSDP2's ``fully_shard`` does:
its class becomes ``STPC<Class>`` (a subclass of :class:`DistributedModel` and of the
user's class, so ``isinstance`` and the model's own methods — ``init_weights``,
``generate`` helpers — still work), every parameter becomes an ``nn.Parameter``
holding a ``torch.distributed.tensor.DTensor`` of this rank's shard under the plan
(``stpc.runtime.dtensors`` says how stpc placements are stored), and ``forward`` runs
the compiled program. So ``torch.optim``, ``clip_grad_norm_``, ``zero_grad``,
``state_dict`` and ``torch.distributed.checkpoint`` work as on a TorchTitan model.
Buffers stay plain, full tensors (they are small; the program slices them).

Everything stpc keeps lives in one attribute, ``model.stpc`` (:class:`Compiled`): the
plan, the graph, pass dumps, and the programs of the input signatures seen so far.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from stpc import passes, runtime
from stpc.placement import is_grid, local_shape
from stpc.runtime.dtensors import dtensor_placements, param_local, stored, to_plan_layout
from stpc.runtime.failure import comm_failure
from stpc.runtime.grad_reducer import GradReducer
from stpc.runtime.hook_taps import HookTaps, UnsupportedHook
from stpc.runtime import RegatherSaved
from stpc.validate import PlanWarning

__all__ = ["DistributedModel", "Compiled", "Program", "ShapeMismatch", "full_meta_view", "adopt", "flatten_call",
           "local_bytes", "mesh_device"]


class ShapeMismatch(ValueError):
    """A call whose inputs the compiled model has no program for, and may not plan one."""


@dataclass
class Program:
    """One input signature's SPMD program on this rank.

    ``feed`` says what each placeholder of ``gm`` receives, in order:
    ``("param", fqn, placement)`` (its local tensor, laid out as planned), ``("param_ref", fqn,
    placement)`` (the parameter itself: the program reads it where it first uses it,
    ``passes.read_params_at_use``), ``("buffer", fqn, placement)``,
    ``("input", leaf, placement, local)`` (leaf = index into the flattened
    ``(args, kwargs)``; ``local``: the caller passes its own shard) or
    ``("const", leaf)`` (a non-tensor leaf export baked into the graph).
    """

    plan: object
    gm: fx.GraphModule
    fn: Callable
    feed: list
    in_spec: object
    out_spec: object
    out_placements: list            # per flat output: placement tokens (None: not a tensor)
    out_shapes: list                # per flat output: global shape (None: not a tensor)
    snapshots: list = field(default_factory=list)
    deferred: dict = field(default_factory=dict)  # param FQN -> group its gradient is summed over after
                                                  # backward, in the order backward completes them
    bucket_bytes: int = 0
    keep_buckets: bool = False      # the reducer keeps its buckets between steps (the plan's memory model
                                    # held them through forward: ``MemoryModel.kept_buckets``)
    reducer: object = None          # the runtime.GradReducer of ``deferred`` (made at the first run)
    calls: list = field(default_factory=list)     # the traced submodule calls (frontend.module_calls)
    backend: str | None = None      # torch.compile backend of ``fn`` (None: eager)
    regathers: frozenset = frozenset()  # eager: the groups whose coalesced parameter gathers backward
                                        # makes again (a RegatherSaved); the others' are kept
    variants: dict = field(default_factory=dict)  # hooked submodule FQNs -> (fn, HookTaps): the program
                                                  # tapped so their forward hooks fire


def _leaf_key(x, local: bool):
    if isinstance(x, DTensor):  # fed by redistributing: the same program as a full tensor
        return ("tensor", tuple(x.shape), x.dtype)
    if isinstance(x, torch.Tensor):
        return ("local" if local else "tensor", tuple(x.shape), x.dtype)
    return ("const", type(x).__name__, repr(x))


def _describe(key) -> str:
    if key[0] == "const":
        return f"{key[1]} {key[2]}"
    return f"{'local shard ' if key[0] == 'local' else ''}shape {key[1]} and dtype {key[2]}"


def flatten_call(args, kwargs):
    """The leaves and structure of a call; keyword arguments in name order, so the order a
    caller writes them in does not make a new signature."""
    return pytree.tree_flatten((tuple(args), dict(sorted(dict(kwargs).items()))))


class Compiled:
    """What stpc keeps on a compiled model (``model.stpc``).

    ``plan`` / ``graph_module`` are those of the program compiled first (the example
    inputs); ``programs`` maps every input signature seen to its program. A call with a
    new signature is planned anew (``make_program``, every rank agreeing on the
    signature first) while fewer than ``max_plans`` programs exist; otherwise it raises
    :class:`ShapeMismatch` naming the compiled and the given shapes.
    """

    def __init__(self, *, mesh: DeviceMesh, storage: DeviceMesh, grids: tuple, groups: list[str],
                 param_placements: dict, orig_class: type, make_program: Callable, max_plans: int,
                 local_leaves: dict, check_group=None):
        self.mesh = mesh                  # the plan's mesh (one dim per plan axis)
        self.storage_mesh = storage       # parameters' DTensor mesh (grid axes split in two)
        self.grids = grids
        self.groups = groups
        self.coords = tuple(int(c) for c in mesh.get_coordinate())
        self.device = mesh_device(mesh)
        self.param_placements = param_placements   # fqn -> plan placement it is stored for
        self.orig_class = orig_class
        self.make_program = make_program
        self.max_plans = max_plans
        self.local_leaves = local_leaves  # leaf index -> placement of the shard the caller feeds
        self.programs: dict = {}
        self.first = None
        self.check_group = check_group    # where every call's signature is compared (None: WORLD)
        self._digests: dict = {}
        self._hooks_warned: tuple = ()

    # ------------------------------------------------------------------ views
    @property
    def plan(self):
        return self.programs[self.first].plan

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.programs[self.first].gm

    def dump_passes(self, directory: str) -> list[str]:
        """A table (and DOT) of the first program's graph after each pass: ``NN_<pass>.txt``."""
        os.makedirs(directory, exist_ok=True)
        paths = []
        for i, (name, text, dot) in enumerate(self.programs[self.first].snapshots):
            base = os.path.join(directory, f"{i:02d}_{name}")
            with open(base + ".txt", "w") as f:
                f.write(text)
            with open(base + ".dot", "w") as f:
                f.write(dot)
            paths += [base + ".txt", base + ".dot"]
        return paths

    def add(self, key, program: Program) -> None:
        self.programs[key] = program
        if self.first is None:
            self.first = key

    # ------------------------------------------------------------------ calls
    def signature(self, flat, spec, training: bool, example: bool = False):
        """The key of a call: its pytree structure, every leaf's shape and dtype (a constant's
        value) and train/eval mode. ``example``: ``flat`` are the compile-time example inputs,
        full tensors even where the caller will feed shards (keyed by the shard's shape)."""
        keys = []
        mesh_shape = tuple(int(n) for n in self.mesh.shape)
        for i, x in enumerate(flat):
            local = i in self.local_leaves
            if example and local and isinstance(x, torch.Tensor):
                x = torch.empty(local_shape(tuple(x.shape), self.local_leaves[i], mesh_shape), dtype=x.dtype,
                                device="meta")
            keys.append(_leaf_key(x, local))
        return (str(spec), tuple(keys), bool(training))

    def run(self, module: nn.Module, args, kwargs):
        runtime.settle()  # what the last call handed out unread (its loss) is waited before this one
        flat, spec = flatten_call(args, kwargs)
        key = self.signature(flat, spec, module.training)
        hooked = self._hooked_submodules(module)
        self._agree(key)
        prog = self.programs.get(key)
        if prog is None:
            prog = self._new_program(module, key, args, kwargs)
        # every name, a tied alias's too: one walk of the module per call, not one per parameter
        params = dict(module.named_parameters(remove_duplicate=False))
        self._arm_reducer(module, prog, params)
        fn, taps = self._runner(prog, hooked)
        if taps is not None:
            taps.begin(module)
        # eager programs do not keep whole gathered parameters for backward (FSDP2's default)
        regather = RegatherSaved(prog.regathers) if prog.regathers and torch.is_grad_enabled() else contextlib.nullcontext()
        try:
            with regather:
                out = fn(*self._feed(module, prog, flat, params))
        except RuntimeError as e:  # a compiled program's collectives fail inside generated code
            if isinstance(e, UnsupportedHook):
                raise
            raise comm_failure("step of the compiled program", None, e) from e
        if taps is not None:
            taps.end()
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        out = [self._wrap_output(x, p, s) for x, p, s in zip(out, prog.out_placements, prog.out_shapes)]
        return pytree.tree_unflatten(out, prog.out_spec)

    def _arm_reducer(self, module, prog: Program, params: dict) -> None:
        """The backward of this call sums its deferred gradients with this program's reducer
        (built on first use: the parameters are the module's DTensors by then; built again
        when one of them was replaced since); other programs' reducers stand aside."""
        if prog.deferred:
            deferred = [(_param(module, params, fqn), group) for fqn, group in prog.deferred.items()]
            if prog.reducer is not None and not prog.reducer.holds(deferred):
                # a parameter was replaced or converted since: hook the module's own now, or its
                # gradient would reach .grad unsummed over the data-parallel ranks
                prog.reducer.remove()
                prog.reducer = None
            if prog.reducer is None:  # a tied parameter (several names) in a bucket of its own
                names = collections.Counter(id(p) for p in params.values())
                prog.reducer = GradReducer(deferred, prog.bucket_bytes, keep_buffers=prog.keep_buckets,
                                           alone=frozenset(i for i, n in names.items() if n > 1))
        for other in self.programs.values():
            if other.reducer is not None:
                other.reducer.enabled = other is prog

    def _hooked_submodules(self, module) -> frozenset:
        """The submodules with forward hooks (their hooks fire from a tapped program,
        ``_runner``). Backward hooks on submodules cannot fire (the program replaces their
        calls): say so, once per set of such submodules, instead of leaving them silently dead."""
        hooked, backward = [], []
        for name, m in module.named_modules():
            if name and (m._forward_hooks or m._forward_pre_hooks):
                hooked.append(name)
            if name and (m._backward_hooks or m._backward_pre_hooks):
                backward.append(name)
        backward = tuple(backward)
        if backward and backward != self._hooks_warned:
            self._hooks_warned = backward
            more = f" and {len(backward) - 3} more" if len(backward) > 3 else ""
            warnings.warn(f"stpc: backward hooks on submodules {', '.join(backward[:3])}{more} do not fire: the "
                          f"compiled program replaces their calls (forward hooks on submodules, hooks on the model "
                          f"itself and on parameters and their gradients do). Fix: hook the parameters' gradients "
                          f"(register_post_accumulate_grad_hook) or the compiled model itself", PlanWarning,
                          stacklevel=4)
        return frozenset(hooked)

    def _runner(self, prog: Program, hooked: frozenset):
        """``(callable, HookTaps or None)`` running ``prog`` so the forward hooks of the
        ``hooked`` submodules fire: the program itself when none of them is called in it,
        else a tapped copy (``passes.tap_hooks``), made once per set of hooked submodules."""
        hooked = frozenset(fqn for fqn in hooked if any(c.fqn == fqn for c in prog.calls))
        if not hooked:
            return prog.fn, None
        if hooked not in prog.variants:
            taps = HookTaps(prog.calls, self.mesh, self.groups)
            gm, slots, wanted = passes.tap_hooks(prog.gm, prog.calls, hooked.__contains__, taps.key)
            taps.attach(slots, wanted)
            fn = torch.compile(gm, backend=prog.backend) if prog.backend else gm
            prog.variants[hooked] = (fn, taps)
        return prog.variants[hooked]

    def _agree(self, key) -> None:
        """Every call, before any of its communication: the ranks compare the call's
        signature's digest (one all-reduce of two integers, ``runtime.check_plan_agreement``;
        the whole digests are all-gathered only where they differ, to name the ranks), so ranks
        called with different shapes (each compiled, or one new) raise :class:`ShapeMismatch`
        together instead of running different programs against each other."""
        digest = self._digests.get(key)
        if digest is None:
            digest = self._digests[key] = hashlib.sha256(repr(key).encode()).hexdigest()
        _check_same_on_all_ranks(digest, what="input signature", group=self.check_group,
                                 shown=[_describe(k) for k in key[1]])

    def _new_program(self, module, key, args, kwargs) -> Program:
        first = self.programs[self.first]
        first_key = self.first
        if len(self.programs) >= self.max_plans:
            given = [_describe(k) for k in key[1]]
            compiled = [_describe(k) for k in first_key[1]]
            raise ShapeMismatch(
                f"stpc: the model was compiled for inputs with {compiled}"
                f"{' in train mode' if first_key[2] else ' in eval mode'}; this call gives {given}"
                f"{' in train mode' if key[2] else ' in eval mode'} and {len(self.programs)} plan(s) are "
                f"cached (max_plans={self.max_plans}). Fix: call with the compiled shapes, or "
                f"stpc.compile with a larger max_plans so other shapes are planned too")
        prog = self.make_program(module, args, kwargs, first)
        self.add(key, prog)
        return prog

    def _feed(self, module, prog: Program, flat, params: dict) -> list:
        shape = tuple(prog.plan.mesh_shape)
        out = []
        for entry in prog.feed:
            kind = entry[0]
            if kind == "param":
                _, fqn, placement = entry
                p = _param(module, params, fqn)
                local = param_local(p) if isinstance(p, DTensor) else p
                out.append(to_plan_layout(local, placement, self.groups) if any(is_grid(t) for t in placement)
                           else local)
            elif kind == "param_ref":
                out.append(_param(module, params, entry[1]))
            elif kind == "buffer":
                _, fqn, placement = entry
                out.append(runtime.shard_tensor(module.get_buffer(fqn), placement, shape, self.coords))
            elif kind == "input":
                _, leaf, placement, given_local = entry
                out.append(self._input(flat[leaf], placement, given_local, shape))
            else:
                out.append(flat[entry[1]])
        return out

    def _input(self, x, placement, given_local: bool, shape):
        if isinstance(x, DTensor):  # a DTensor says where its pieces are: move them where the plan wants
            if x.device_mesh != self.mesh:
                raise ValueError(f"stpc: a DTensor input lives on {x.device_mesh}; the model runs on "
                                 f"{self.mesh}. Fix: build the input on model.stpc.mesh")
            if any(is_grid(t) for t in placement):
                return runtime.shard_tensor(x.full_tensor(), placement, shape, self.coords)
            return x.redistribute(self.mesh, dtensor_placements(placement, ())).to_local()
        if given_local:
            return x if x.device == self.device else x.to(self.device)
        return runtime.shard_tensor(x, placement, shape, self.coords).to(self.device)

    def _wrap_output(self, x, placement, global_shape):
        if placement is None or not isinstance(x, torch.Tensor) or all(t == "R" for t in placement):
            return x
        return DTensor.from_local(x, self.mesh, dtensor_placements(placement, ()), run_check=False,
                                  shape=torch.Size(global_shape),
                                  stride=torch.empty(global_shape, device="meta").stride())


def _param(module: nn.Module, params: dict, fqn: str):
    """The module's parameter ``fqn`` (from this call's ``named_parameters``; where it is
    not there, ``get_parameter`` says what is missing)."""
    p = params.get(fqn)
    return p if p is not None else module.get_parameter(fqn)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """Where this rank's tensors live on ``mesh``: its current CUDA device, or the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _check_same_on_all_ranks(digest: str, what: str, group=None, shown=None) -> None:
    try:
        runtime.check_plan_agreement(digest, group)
    except runtime.PlanMismatch as e:
        mine = f"; this rank was called with {shown}" if shown else ""
        raise ShapeMismatch(f"stpc: ranks were called with different {what}s ({e}){mine}. Fix: every rank must "
                            f"call the model with inputs of the same shapes and dtypes") from None


class DistributedModel(nn.Module):
    """The base of every compiled model's class (``STPC<Class>``): ``forward`` runs the
    SPMD program on every rank; see the module docstring."""

    stpc: Compiled

    def forward(self, *args, **kwargs):
        return self.stpc.run(self, args, kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``, and it re-lays what it is given: a full, plain
        tensor (a single-device checkpoint) becomes this rank's shard, a DTensor of other
        placements is redistributed to the parameter's own."""
        current = dict(self.named_parameters(remove_duplicate=False))
        laid = {}
        for k, v in state_dict.items():
            p = current.get(k)
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                v = distribute_tensor(v.detach().to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            elif isinstance(p, DTensor) and isinstance(v, DTensor) and (v.device_mesh != p.device_mesh or
                                                                       v.placements != p.placements):
                v = (v.redistribute(p.device_mesh, p.placements) if v.device_mesh == p.device_mesh else
                     distribute_tensor(v.full_tensor(), p.device_mesh, p.placements, src_data_rank=None))
            laid[k] = v
        return super().load_state_dict(laid, strict=strict, assign=assign)

    def __repr__(self) -> str:
        plan = self.stpc.plan
        return (f"STPC[{self.stpc.orig_class.__name__} on mesh {'x'.join(map(str, plan.mesh_shape))}, "
                f"plan {plan.hash()[:12]}]")


_SWAPPED: dict[type, type] = {}


def _swapped_class(cls: type) -> type:
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"STPC{cls.__name__}", (DistributedModel, cls), {"__module__": cls.__module__})
    return _SWAPPED[cls]


def _slots(model: nn.Module, kind: str):
    """(module, name, tensor) for every parameter or buffer slot, tied ones included."""
    for mod in model.modules():
        table = mod._parameters if kind == "param" else mod._buffers
        for name, t in table.items():
            if t is not None:
                yield mod, name, t


@contextlib.contextmanager
def full_meta_view(model: nn.Module):
    """``model`` as its author wrote it, for tracing: its own class and every parameter and
    buffer a ``meta`` tensor of its full shape (tied ones stay tied). Nothing is allocated;
    everything is put back on exit."""
    orig_class = model.stpc.orig_class if isinstance(model, DistributedModel) else type(model)
    saved_class = type(model)
    saved = []
    meta_of: dict[int, torch.Tensor] = {}
    try:
        model.__class__ = orig_class
        for kind in ("param", "buffer"):
            for mod, name, t in list(_slots(model, kind)):
                m = meta_of.get(id(t))
                if m is None:
                    m = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                    if kind == "param":
                        m = nn.Parameter(m, requires_grad=t.requires_grad)
                    meta_of[id(t)] = m
                table = mod._parameters if kind == "param" else mod._buffers
                saved.append((table, name, t))
                table[name] = m
        yield model
    finally:
        for table, name, t in reversed(saved):
            table[name] = t
        model.__class__ = saved_class


def adopt(model: nn.Module, compiled: Compiled) -> nn.Module:
    """Make ``model`` the compiled model in place: its class ``STPC<Class>``, each parameter a
    DTensor of this rank's shard under ``compiled.param_placements`` (cut from the full
    tensor this rank holds, or on ``meta`` if the model is), buffers on the mesh's device.
    Tied parameters stay one ``nn.Parameter``."""
    shape = tuple(int(n) for n in compiled.mesh.shape)
    new: dict[int, nn.Parameter] = {}
    fqn_of = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        fqn_of.setdefault(id(p), fqn)
    for mod, name, p in list(_slots(model, "param")):
        if id(p) not in new:
            placement = compiled.param_placements.get(fqn_of[id(p)], ("R",) * len(shape))
            keep = stored(placement)
            full = p.detach()
            device = full.device if full.device.type == "meta" else compiled.device
            local = runtime.shard_tensor(full, keep, shape, compiled.coords).to(device, copy=True)
            dt = DTensor.from_local(local, compiled.storage_mesh, dtensor_placements(keep, compiled.grids),
                                    run_check=False, shape=full.shape, stride=full.stride())
            new[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
        mod._parameters[name] = new[id(p)]
    for mod, name, b in list(_slots(model, "buffer")):
        if b.device.type != "meta":
            mod._buffers[name] = b.to(compiled.device)
    model.__class__ = _swapped_class(type(model))
    model.stpc = compiled
    return model


def local_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage this rank holds (its shards; tied parameters once)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes()
               for p in model.parameters())
