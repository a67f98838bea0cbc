"""selfcheck: the three spatial-temporal primitives against one plain matmul, on real ranks.

``check_primitives(rank, world)`` runs on every rank of a process group (spawn it:
``stpc.runtime.launch.spawn(check_primitives, 4)``). Every rank draws the same full
``x [B, S, N]``, ``w [N, K]`` and upstream gradient ``g [B, S, K]`` from one seed, in
float64, and takes the single-device reference: ``out = x @ w`` and, by autograd on
``(out * g).sum()``, ``dx`` and ``dw``. Then, with its own block of each operand:

* ``ag_ring`` (``torch.ops.stpc.ring_allgather_matmul``): x split on S (rank i: rows
  block i), w on K (columns block i); out is the rank's K block of the whole S;
* ``rs_ring`` (``torch.ops.stpc.ring_matmul_reducescatter``): x and w split on the
  contraction N; out is the rank's S block of the sum over ranks;
* ``p2x2`` (``torch.ops.stpc.primepar_linear``, on 4**k ranks as a 2^k x 2^k grid):
  Cannon's skewed blocks (``primepar_shard_input`` / ``_weight`` / ``_output``);

each in ``dtype``, forward and backward, its ``out``, ``dx`` and ``dw`` compared with the
reference's blocks in the same layouts. An error is ``max |got - ref| / max |ref|`` over the
rank's block (relative to the operand's scale); the result is the largest over all ranks
(every rank returns the same numbers), so one table says whether the rings and the grid
compute exactly what one device would.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from stpc.runtime.ops.ring import (primepar_coords, primepar_linear, primepar_shard_input, primepar_shard_output,
                                   primepar_shard_weight, ring_allgather_matmul, ring_matmul_reducescatter)

__all__ = ["check_primitives", "PRIMITIVES", "TOLERANCE"]

PRIMITIVES = {
    "ag_ring": "stpc::ring_allgather_matmul (AG-ring): x split on S, w on K",
    "rs_ring": "stpc::ring_matmul_reducescatter (RS-ring): x and w split on N, out on S",
    "p2x2": "stpc::primepar_linear (P(2^k x 2^k)): x, w, out in Cannon's skewed grid blocks",
}
# what float rounding allows at the default sizes (the sums are a few dozen terms long)
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape or not torch.isfinite(got).all():
        return math.inf
    scale = float(ref.abs().max()) or 1.0
    return float((got.double() - ref).abs().max()) / scale


def _grid_k(world: int) -> int | None:
    """k with 4**k == world, else None."""
    k = round(math.log(world, 4)) if world >= 4 else 0
    return k if k >= 1 and 4 ** k == world else None


def check_primitives(rank: int, world: int, seed: int = 0, shape: tuple[int, int, int] = (2, 8, 16),
                     k_out: int = 8, dtype: torch.dtype = torch.float32) -> dict:
    """Per primitive, ``{"out", "dx", "dw"}``: the largest relative error over all ranks of
    its forward output and both gradients against the single-device float64 matmul (see the
    module's docstring); ``None`` for ``p2x2`` when ``world`` is not 4**k. ``shape`` is the
    full ``(B, S, N)`` of x and ``k_out`` the full K of w: S, N and K must divide by
    ``world`` (and by 2^k for the grid). Every rank of the default group must call it."""
    B, S, N = shape
    K = k_out
    for what, n in (("S", S), ("N", N), ("K", K)):
        if n % world:
            raise ValueError(f"check_primitives: {what}={n} does not divide by the {world} ranks")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, N, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(N, K, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(B, S, K, generator=gen, dtype=torch.float64)
    out = x @ w  # the reference: one device, float64
    out.backward(g)
    ref = {"out": out.detach(), "dx": x.grad, "dw": w.grad}
    x, w = x.detach(), w.detach()

    def run(fn, xl, wl, gl):
        xl = xl.to(dtype).requires_grad_()
        wl = wl.to(dtype).requires_grad_()
        o = fn(xl, wl)
        o.backward(gl.to(dtype))
        return o.detach(), xl.grad, wl.grad

    results: dict[str, dict | None] = {}
    P, i = world, rank
    s, n, k = S // P, N // P, K // P

    # AG-ring: x rows block i (dim 1), w columns block i; out = all_gather(x) @ w_i
    got = run(lambda a, b: ring_allgather_matmul(a, b, 1), x[:, i * s:(i + 1) * s], w[:, i * k:(i + 1) * k],
              g[..., i * k:(i + 1) * k])
    want = (ref["out"][..., i * k:(i + 1) * k], ref["dx"][:, i * s:(i + 1) * s], ref["dw"][:, i * k:(i + 1) * k])
    results["ag_ring"] = dict(zip(("out", "dx", "dw"), map(_err, got, want)))

    # RS-ring: x and w split on the contraction N; out = reduce_scatter(x_i @ w_i) on dim 1
    got = run(lambda a, b: ring_matmul_reducescatter(a, b, 1), x[..., i * n:(i + 1) * n],
              w[i * n:(i + 1) * n], g[:, i * s:(i + 1) * s])
    want = (ref["out"][:, i * s:(i + 1) * s], ref["dx"][..., i * n:(i + 1) * n], ref["dw"][i * n:(i + 1) * n])
    results["rs_ring"] = dict(zip(("out", "dx", "dw"), map(_err, got, want)))

    # P(2^k x 2^k): the grid's skewed blocks
    kk = _grid_k(world)
    if kk is None:
        results["p2x2"] = None
    else:
        r, c = primepar_coords(rank, kk)
        got = run(lambda a, b: primepar_linear(a, b, None, kk), primepar_shard_input(x, r, c, kk),
                  primepar_shard_weight(w, r, c, kk), primepar_shard_output(g, r, c, kk))
        want = (primepar_shard_output(ref["out"], r, c, kk), primepar_shard_input(ref["dx"], r, c, kk),
                primepar_shard_weight(ref["dw"], r, c, kk))
        results["p2x2"] = dict(zip(("out", "dx", "dw"), map(_err, got, want)))

    # the largest error over all ranks, the same on every rank
    keys = [(p, q) for p, errs in results.items() if errs for q in errs]
    errs = torch.tensor([results[p][q] for p, q in keys], dtype=torch.float64)
    errs = torch.nan_to_num(errs, nan=math.inf)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    for (p, q), e in zip(keys, errs.tolist()):
        results[p][q] = e
    return results
