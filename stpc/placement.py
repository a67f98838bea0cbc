"""Placements: how one tensor lies over the mesh, one token per mesh axis.

The vocabulary is torch.distributed.tensor's, written as short strings so plans
are JSON and hashing is cheap:

  "R"        Replicate()
  "S{d}"     Shard(d)
  "P"        Partial() (sum)

plus three tokens for PrimePar's P(2^k x 2^k) on an axis of 4^k devices viewed
as a 2^k x 2^k grid, device (r, c) = axis rank r*2^k + c, over tensor dims i, j:

  "B{i}.{j}"  block (r, c): dim i split over grid rows, dim j over columns
              (the output layout of a P2x2 linear)
  "X{i}.{j}"  skewed block (r, r+c): the input layout of a P2x2 linear
  "W{i}.{j}"  skewed block (c, r+c): the weight layout ([K, N], torch's
              out x in order) of a P2x2 linear

A placement is a tuple of tokens, e.g. ("S0", "S2") on a 2-D mesh.
"""
from __future__ import annotations

import math
from functools import lru_cache

REPLICATE = "R"
PARTIAL = "P"


def shard(d: int) -> str:
    return f"S{d}"


def block(kind: str, i: int, j: int) -> str:
    return f"{kind}{i}.{j}"


@lru_cache(maxsize=None)
def parse(token: str) -> tuple[str, tuple[int, ...]]:
    """``"S2" -> ("S", (2,))``, ``"X1.2" -> ("X", (1, 2))``, ``"R" -> ("R", ())``."""
    kind, rest = token[0], token[1:]
    return kind, tuple(int(x) for x in rest.split(".")) if rest else ()


def is_grid(token: str) -> bool:
    return token[0] in "BXW"


def dims_split(token: str) -> tuple[int, ...]:
    return parse(token)[1]


def local_shape(shape: tuple[int, ...], placement: tuple[str, ...], mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Per-device shape of a tensor of ``shape`` under ``placement`` (even splits assumed)."""
    out = list(shape)
    for tok, n in zip(placement, mesh):
        kind, dims = parse(tok)
        if kind == "S":
            out[dims[0]] //= n
        elif kind in "BXW":
            g = math.isqrt(n)
            for d in dims:
                out[d] //= g
    return tuple(out)


def shard_factor(placement, mesh, skip_axis: int = -1) -> int:
    """How many pieces the tensor's data is cut into (R and P keep it whole)."""
    try:
        return _shard_factor(placement, mesh, skip_axis)
    except TypeError:  # a list: unhashable
        return _shard_factor(tuple(placement), tuple(mesh), skip_axis)


@lru_cache(maxsize=None)  # the planner asks the same few questions hundreds of thousands of times
def _shard_factor(placement: tuple[str, ...], mesh: tuple[int, ...], skip_axis: int) -> int:
    f = 1
    for a, (tok, n) in enumerate(zip(placement, mesh)):
        if a != skip_axis and tok[0] in "SBXW":
            f *= n
    return f


def fits(shape, placement, mesh) -> bool:
    """Every split divides its dim evenly (the runtime shards evenly)."""
    try:
        return _fits(shape, placement, mesh)
    except TypeError:  # a list: unhashable
        return _fits(tuple(shape), tuple(placement), tuple(mesh))


@lru_cache(maxsize=None)
def _fits(shape: tuple[int, ...], placement: tuple[str, ...], mesh: tuple[int, ...]) -> bool:
    need = [1] * len(shape)
    for tok, n in zip(placement, mesh):
        kind, dims = parse(tok)
        if kind == "S":
            if dims[0] >= len(shape):
                return False
            need[dims[0]] *= n
        elif kind in "BXW":
            g = math.isqrt(n)
            if g * g != n or any(d >= len(shape) for d in dims):
                return False
            for d in dims:
                need[d] *= g
    return all(s % k == 0 for s, k in zip(shape, need))


def grid_index(kind: str, r: int, c: int, q: int) -> tuple[int, int]:
    """(piece of dim i, piece of dim j) that grid device (r, c) of a q x q grid holds under
    grid token kind ``kind`` (the module docstring's B, X and W)."""
    if kind == "B":
        return r, c
    if kind == "X":
        return r, (r + c) % q
    if kind == "W":
        return c, (r + c) % q
    raise ValueError(f"not a grid token kind: {kind!r}")


def _piece(token: str, rank: int, n: int) -> dict[int, tuple[int, int]]:
    """The slice of each split dim that axis rank ``rank`` of ``n`` holds under split token
    ``token``, as (index, count) of equal pieces: S(d) the rank-th of n along d; a grid
    token the (row, column) pieces of its kind (B (r, c), X (r, r+c), W (c, r+c), q = sqrt n)."""
    kind, dims = parse(token)
    if kind == "S":
        return {dims[0]: (rank, n)}
    q = math.isqrt(n)
    a, b = grid_index(kind, *divmod(rank, q), q)
    return {dims[0]: (a, q), dims[1]: (b, q)}


def _overlap(p: dict, q: dict) -> float:
    """Fraction of the whole tensor two pieces share (dims neither splits: whole in both)."""
    f = 1.0
    for d in set(p) | set(q):
        (i, m), (j, k) = p.get(d, (0, 1)), q.get(d, (0, 1))
        lo, hi = max(i / m, j / k), min((i + 1) / m, (j + 1) / k)
        f *= max(hi - lo, 0.0)
    return f


@lru_cache(maxsize=None)
def received_fraction(src: str, dst: str, n: int) -> float:
    """Going from split token ``src`` to split token ``dst`` on an axis of ``n`` ranks, the
    most any rank must receive, as a fraction of its own piece: its ``dst`` piece less what
    its ``src`` piece already holds of it (``runtime.redistribute`` moves exactly that).
    (n - 1) / n between two plain splits of different dims, as an all-to-all; less where the
    layouts share slices (a sequence split of 4 into a 2x2 block of sequence and hidden:
    1/2); 0 for the same token."""
    worst = 0.0
    for rank in range(n):
        mine = _piece(dst, rank, n)
        need = _overlap(mine, mine)
        worst = max(worst, (need - _overlap(_piece(src, rank, n), mine)) / need)
    return worst


def fmt(placement: tuple[str, ...]) -> str:
    return "(" + ",".join(placement) + ")"
