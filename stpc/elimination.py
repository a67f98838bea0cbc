"""eliminate: the exact minimum of a sum of unary and pairwise costs, by variable elimination.

The solver's problem without its memory rows is a min-sum factor graph: one
cost vector per group and one cost matrix per pair of groups joined by edges.
A transformer's tied problem has tree width 2 (the residual stream closes one
cycle per block), so eliminating one group at a time leaves factors of at most
two groups, and the exact optimum costs a few small (min, +) products instead
of a CP-SAT search.

Eliminating group x with neighbours a and b:
    R[a, b] = min_x U[x] + A[x, a] + B[x, b]
Many choices of x look alike to a neighbour (a per-axis edge only sees the
token on its axis), so x's choices are first grouped by their row of A and of
B; only the cheapest choice of each (row of A, row of B) pair can be the
minimum, and R becomes two (min, +) products over those classes.

Everything is int64 (nanoseconds, or the lexicographic key of
:func:`lexicographic`): exact, and ties resolve to the lowest choice index, so
the result is the same in every process. A group left with three or more
neighbours is eliminated densely while its table stays under ``max_table``
entries; beyond that :class:`TooWide` tells the caller to use CP-SAT instead.
"""
from __future__ import annotations

import numpy as np

INF = np.int64(1 << 61)  # "no choice of x has this class pair"; finite sums stay far below


class TooWide(Exception):
    """Some elimination step would need a table larger than ``max_table`` entries."""


def eliminate(unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
              max_table: int = 4_000_000) -> tuple[int, list[int]]:
    """Minimise ``sum_g unary[g][c_g] + sum_(a,b) pairs[a,b][c_a, c_b]`` exactly.

    ``pairs`` is keyed by ``(a, b)`` with ``a < b``, each matrix ``len(unary[a]) x
    len(unary[b])``. Returns ``(minimum, choice per group)``.
    """
    n = len(unary)
    dom = [len(u) for u in unary]
    # factors: variables (sorted tuple) -> table with one axis per variable
    factors: dict[tuple[int, ...], np.ndarray] = {(g,): np.asarray(u, dtype=np.int64) for g, u in enumerate(unary)}
    for (a, b), m in pairs.items():
        _add_factor(factors, (a, b), np.asarray(m, dtype=np.int64))
    touching: list[set] = [set() for _ in range(n)]
    for vs in factors:
        for v in vs:
            touching[v].add(vs)
    alive = set(range(n))
    eliminated: list[tuple[int, list[tuple[tuple[int, ...], np.ndarray]]]] = []
    total = 0
    while alive:
        x = min(alive, key=lambda v: _elimination_cost(v, touching, dom))
        fs = [(vs, factors.pop(vs)) for vs in sorted(touching[x])]
        for vs, _ in fs:
            for v in vs:
                if v != x:
                    touching[v].discard(vs)
        touching[x].clear()
        alive.discard(x)
        eliminated.append((x, fs))
        others = tuple(sorted({v for vs, _ in fs for v in vs if v != x}))
        table = _min_out(x, fs, others, dom, max_table)
        if not others:
            total += int(table)
            continue
        _add_factor(factors, others, table)
        for v in others:
            touching[v].add(others)
    choice = [0] * n
    for x, fs in reversed(eliminated):  # back-substitute: neighbours are already chosen
        val = np.zeros(dom[x], dtype=np.int64)
        for vs, t in fs:
            idx = tuple(slice(None) if v == x else choice[v] for v in vs)
            val = val + t[idx]
        choice[x] = int(np.argmin(val))
    return total, choice


def _add_factor(factors, vs, table):
    factors[vs] = factors[vs] + table if vs in factors else table


def _elimination_cost(x, touching, dom):
    others = {v for vs in touching[x] for v in vs if v != x}
    size = 1
    for v in others:
        size *= dom[v]
    return (len(others), size, x)


def _min_out(x, fs, others, dom, max_table):
    """The table over ``others`` of min over x of the sum of the factors ``fs``."""
    by_other: dict[int, np.ndarray] = {}  # neighbour -> summed (x, neighbour) matrix
    u = np.zeros(dom[x], dtype=np.int64)
    wide = False
    for vs, t in fs:
        if len(vs) == 1:
            u = u + t
        elif len(vs) == 2:
            o = vs[0] if vs[1] == x else vs[1]
            m = t if vs[0] == x else t.T
            by_other[o] = by_other[o] + m if o in by_other else m
        else:
            wide = True
    if not others:
        return u.min()
    if not wide and len(others) == 1:
        return (u[:, None] + by_other[others[0]]).min(axis=0)
    if not wide and len(others) == 2:
        return _min_plus_two(u, by_other[others[0]], by_other[others[1]])
    return _dense(x, fs, others, dom, max_table)


def _min_plus_two(u, a, b):
    """R[i, j] = min_x u[x] + a[x, i] + b[x, j], over classes of x's rows."""
    ra, ca = _row_classes(a)   # ra: distinct rows of a; ca: each x's row
    rb, cb = _row_classes(b)
    g = np.full(len(ra) * len(rb), INF, dtype=np.int64)
    np.minimum.at(g, ca * len(rb) + cb, u)              # cheapest x of each class pair
    g = g.reshape(len(ra), len(rb))
    if len(ra) > len(rb):  # loop over the smaller class count
        return _min_plus_two_loop(g.T, rb, ra).T
    return _min_plus_two_loop(g, ra, rb)


def _min_plus_two_loop(g, ra, rb):
    # h[p, j] = min_q g[p, q] + rb[q, j]; R[i, j] = min_p ra[p, i] + h[p, j].
    # Neighbour choices with equal columns get equal rows (columns) of R: compute
    # R once per distinct column and expand.
    h = (g[:, :, None] + rb[None, :, :]).min(axis=1)
    ci, ii = _row_classes(ra.T)   # ci: distinct columns of ra, (I, P)
    cj, jj = _row_classes(h.T)    # (J, P)
    if ci.shape[0] * cj.shape[0] * ci.shape[1] <= 4_000_000:
        small = (ci[:, None, :] + cj[None, :, :]).min(axis=2)
    else:
        small = None
        for p in range(ci.shape[1]):
            cand = ci[:, p][:, None] + cj[:, p][None, :]
            small = cand if small is None else np.minimum(small, cand)
    return small[ii][:, jj]


def _row_classes(m):
    """(distinct rows of m in first-seen order, index of each row's class). Hashing the
    rows' bytes is several times faster than np.unique's sort of structured rows."""
    m = np.ascontiguousarray(m)
    seen: dict[bytes, int] = {}
    inv = np.fromiter((seen.setdefault(r.tobytes(), len(seen)) for r in m), dtype=np.intp, count=len(m))
    first = np.zeros(len(seen), dtype=np.intp)
    first[inv[::-1]] = np.arange(len(m) - 1, -1, -1)
    return m[first], inv


def _dense(x, fs, others, dom, max_table):
    """Three or more neighbours: accumulate the minimum over x one choice at a time,
    so memory stays at the size of the result table."""
    size = 1
    for v in others:
        size *= dom[v]
    if size > max_table or size * dom[x] > 50 * max_table:
        raise TooWide(f"eliminating group {x} needs a table of {size} x {dom[x]} entries")
    placed = []  # each factor as (axes of x, array broadcastable over others after slicing x)
    for vs, t in fs:
        shape = [dom[v] if v in vs else 1 for v in others]
        ax = vs.index(x)
        rest = [v for v in vs if v != x]
        placed.append((ax, t, shape, rest))
    out = None
    for i in range(dom[x]):
        acc = np.zeros([1] * len(others), dtype=np.int64)
        for ax, t, shape, rest in placed:
            acc = acc + np.take(t, i, axis=ax).reshape(shape)  # vs and others both sorted
        out = acc if out is None else np.minimum(out, acc)
    return np.broadcast_to(out, [dom[v] for v in others]).copy()


__all__ = ["eliminate", "TooWide", "INF"]
