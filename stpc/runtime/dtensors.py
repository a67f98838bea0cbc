"""dtensors: how stpc placements are stored as ``torch.distributed.tensor.DTensor`` s.

A compiled model's parameters are DTensors, so optimizers, ``clip_grad_norm_``,
``state_dict`` and ``torch.distributed.checkpoint`` see standard placements. stpc's
tokens (``stpc.placement``) map onto DTensor placements on a *storage mesh*: the
plan's mesh, with every axis that holds a PrimePar grid layout viewed as its
2^k x 2^k grid (two mesh dims, rows then columns):

  token        on a plain axis        on a grid axis (rows, columns)
  R            Replicate()            Replicate(), Replicate()
  S{d}         Shard(d)               Shard(d), Shard(d)    (nested: row-major rank order)
  P            Partial()              Partial(), Partial()
  B{i}.{j}     -                      Shard(i), Shard(j)
  X / W{i}.{j} stored as B{i}.{j}: the skewed blocks are a permutation of the B blocks
               that no DTensor placement says; :func:`to_plan_layout` applies it (one P2P
               exchange, :func:`stpc.runtime.grid_relayout`) when the program reads the tensor.

One storage mesh for every parameter, so optimizers and ``clip_grad_norm_`` (which
stack per-tensor norms) never mix meshes.
"""
from __future__ import annotations

import copy
import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from stpc.placement import is_grid, parse
from stpc.runtime.reshard import grid_relayout

__all__ = ["grid_axes", "storage_mesh", "stored", "dtensor_placements", "to_plan_layout", "tokens_of", "param_local",
           "read_param", "grad_like"]


def grid_axes(placements) -> tuple[int, ...]:
    """The mesh axes on which any of ``placements`` (token tuples) holds a grid layout."""
    return tuple(sorted({a for p in placements for a, tok in enumerate(p) if is_grid(tok)}))


def storage_mesh(mesh: DeviceMesh, grids: tuple[int, ...], backend_override=None) -> DeviceMesh:
    """``mesh`` with each axis in ``grids`` viewed as its square grid (a collective the first
    time: every rank calls it), its groups made with ``backend_override`` (``(backend,
    options)``, e.g. a timeout). Without grids it is ``mesh`` itself."""
    if not grids:
        return mesh
    shape = []
    for a, n in enumerate(mesh.shape):
        q = math.isqrt(n)
        if a in grids:
            if q * q != n:
                raise ValueError(f"mesh axis {a} of size {n} cannot hold a grid layout (not a square)")
            shape += [q, q]
        else:
            shape.append(n)
    names = []
    for a in range(mesh.ndim):
        names += [f"axis{a}_row", f"axis{a}_col"] if a in grids else [f"axis{a}"]
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=tuple(names),
                      backend_override=None if backend_override is None else (backend_override,) * len(shape))


def stored(placement) -> tuple[str, ...]:
    """The placement a tensor planned as ``placement`` is stored in: skewed grid blocks
    (X, W) are kept as the plain block layout B over the same dims."""
    out = []
    for tok in placement:
        kind, dims = parse(tok)
        out.append(f"B{dims[0]}.{dims[1]}" if kind in "XW" else tok)
    return tuple(out)


def dtensor_placements(placement, grids: tuple[int, ...]) -> tuple[Placement, ...]:
    """DTensor placements on the storage mesh for a *stored* placement (see the table above)."""
    out: list[Placement] = []
    for a, tok in enumerate(placement):
        kind, dims = parse(tok)
        twice = a in grids
        if kind == "R":
            one = [Replicate()]
        elif kind == "S":
            one = [Shard(dims[0])]
        elif kind == "P":
            one = [Partial()]
        elif kind == "B":
            if not twice:
                raise ValueError(f"grid token {tok} on axis {a}, which the storage mesh does not split")
            out += [Shard(dims[0]), Shard(dims[1])]
            continue
        else:
            raise ValueError(f"placement {tok} is not a stored placement; use stored() first")
        out += one * 2 if twice else one
    return tuple(out)


def tokens_of(placements, ndim: int) -> tuple[str, ...]:
    """stpc tokens for user-given DTensor placements (or tokens) on a plain mesh of ``ndim`` axes."""
    placements = tuple(placements)
    if len(placements) != ndim:
        raise ValueError(f"{len(placements)} placements for a mesh of {ndim} axes")
    out = []
    for p in placements:
        if isinstance(p, str):
            kind, _ = parse(p)
            if kind not in "RSP":
                raise ValueError(f"placement {p!r}: only R, S<dim> and P are accepted here")
            out.append(p)
        elif isinstance(p, Shard):
            out.append(f"S{p.dim}")
        elif isinstance(p, Replicate):
            out.append("R")
        elif isinstance(p, Partial):
            out.append("P")
        else:
            raise ValueError(f"placement {p!r} is not Shard, Replicate or Partial")
    return tuple(out)


def to_plan_layout(local: torch.Tensor, placement, groups: list[str]) -> torch.Tensor:
    """This rank's stored block of a tensor planned as ``placement`` -> the block the plan's
    program reads (differentiable): one P2P exchange per axis holding a skewed grid layout."""
    for a, tok in enumerate(placement):
        kind = tok[0]
        if kind in "XW":
            local = grid_relayout(local, "B", kind, groups[a])
    return local


# --------------------------------------------------------------------------- per step


def _plain(spec) -> bool:
    """Whether a DTensor of ``spec`` is contiguous and has no Partial placement: its gradient's
    spec is then its own (what ``to_local``'s backward computes for a contiguous gradient)."""
    shape, stride = tuple(spec.tensor_meta.shape), tuple(spec.tensor_meta.stride)
    want, acc = [], 1
    for n in reversed(shape):
        want.append(acc)
        acc *= max(int(n), 1)
    return stride == tuple(reversed(want)) and not any(p.is_partial() for p in spec.placements)


def _grad_of(spec, g: torch.Tensor) -> DTensor:
    """``g`` (this rank's piece) as a gradient of a DTensor of ``spec``: a DTensor of that
    spec, made directly (``DTensor.from_local`` runs an autograd function and builds a new
    spec: per parameter per step, measurable Python on a small step; FSDP2's
    ``_from_local_no_grad`` does the same). ``from_local`` where the spec is not contiguous
    or holds a Partial, or ``g`` itself requires grad (double backward: from_local keeps it
    differentiable, a direct DTensor would drop the second order). A ``g`` laid out otherwise
    than its contiguous parameter (a transposed matmul result) is copied contiguous first: the
    layout autograd's accumulation gives a plain leaf's gradient, and the one the optimizer's
    elementwise kernels run fast over (over 24 transposed ring gradients, a foreach AdamW step
    took 2.5x its time)."""
    if not g.requires_grad and _plain(spec):
        return DTensor(g if g.is_contiguous() else g.contiguous(), copy.copy(spec), requires_grad=False)
    return DTensor.from_local(g, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


def grad_like(p: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` (this rank's piece) as a gradient of parameter ``p`` (:func:`_grad_of`)."""
    return _grad_of(p._spec, local)


class _ParamLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p):
        ctx.param_spec = p._spec
        ctx.set_materialize_grads(False)
        local = p._local_tensor
        return local.view_as(local)  # (a new tensor object: autograd writes its metadata into it)

    @staticmethod
    def backward(ctx, g):
        return None if g is None else _grad_of(ctx.param_spec, g)


def param_local(p: DTensor) -> torch.Tensor:
    """``p.to_local()`` for a parameter the program reads every call: the same local view, and
    in backward the same gradient (a DTensor of p's placements), made by :func:`grad_like`'s
    direct route instead of ``to_local``'s ``DTensor.from_local``."""
    return _ParamLocal.apply(p)


def read_param(p: torch.Tensor) -> torch.Tensor:
    """A program's read of parameter ``p`` where it first uses it (``passes.read_params_at_use``):
    its local tensor through :func:`param_local` if it is a DTensor, else ``p`` itself."""
    return param_local(p) if isinstance(p, DTensor) else p
