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
token on its axis), so x's choices are grouped by their row of A: a segmented
minimum of U + B over each group, then one (min, +) product over the groups,
only for the distinct columns on each side.

Everything is int64 (nanoseconds, or the solver's lexicographic cost-then-memory
key): exact, and ties resolve to the lowest choice index, so the result is the
same in every process. A group left with three neighbours (the tied embedding of
OPT and BLOOM closes a second cycle) becomes two-neighbour work one of two ways:
two neighbours joined into one, or the smallest fixed value by value, whichever
the tables' distinct rows make cheaper; of two such steps the greedy order cannot
tell apart, the cheaper goes first. Wider steps scan x's choices densely while the
table stays under ``max_table`` entries; beyond that :class:`TooWide` tells the
caller to use CP-SAT instead.
"""
from __future__ import annotations

import math

import numpy as np


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
    eliminated: list[tuple[int, list[tuple[tuple[int, ...], np.ndarray]]]] = []
    total = 0
    order = elimination_order([vs for vs in factors if len(vs) > 1], dom)
    i = 0
    while i < len(order):
        x, plan = _pick(order, i, factors, touching, dom, max_table)
        if x != order[i]:  # a tie went the other way: the greedy order continues from here
            done = set(order[:i]) | {x}
            scopes = [vs for vs in factors if len(vs) > 1 and x not in vs]
            scopes.append(tuple(sorted({v for vs in touching[x] for v in vs if v != x})))
            order = order[:i] + [x] + [v for v in elimination_order(scopes, dom) if v not in done]
        i += 1
        fs = [(vs, factors.pop(vs)) for vs in sorted(touching[x])]
        for vs, _ in fs:
            for v in vs:
                if v != x:
                    touching[v].discard(vs)
        touching[x].clear()
        eliminated.append((x, fs))
        others = tuple(sorted({v for vs, _ in fs for v in vs if v != x}))
        table = plan[1]() if plan else _min_out(x, fs, others, dom, max_table)
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


def _pick(order, i, factors, touching, dom, max_table):
    """The group to eliminate at step i: ``order[i]``, unless that is a three-neighbour
    step and another remaining group's step ties with it on the greedy rules' terms
    (three neighbours, the same table size) but its tables make it cheaper (the
    estimate of ``_three_plan``; the rules see only the graph, not the tables).
    Returns (group, its plan or None)."""
    def size_of(y):  # (neighbours, table size) of y's step
        others = tuple(sorted({v for vs in touching[y] for v in vs if v != y}))
        return others, dom[y] * math.prod(dom[v] for v in others)

    def plan_of(y, others):
        if math.prod(dom[v] for v in others) > max_table:
            return None  # (too wide: _min_out says so)
        return _three_plan(y, [(vs, factors[vs]) for vs in sorted(touching[y])], others, dom)

    x = order[i]
    others, size = size_of(x)
    best = plan_of(x, others) if len(others) == 3 else None
    if best is None:
        return x, None
    for y in order[i + 1:]:
        others_y, size_y = size_of(y)
        if len(others_y) == 3 and size_y == size and (plan := plan_of(y, others_y)) and plan[0] < best[0]:
            x, best = y, plan
    return x, best


def elimination_order(scopes, dom) -> list[int]:
    """An elimination order of small total work, worked out on the graph alone.

    Two greedy rules are simulated and the cheaper kept (work of a step = the size of
    the table it scans, the group's choices times its neighbours'): fewest neighbours
    first, and least weighted fill (the neighbour pairs it newly joins, weighted by
    their table size). The first suits chains; the second keeps small groups in the
    three-neighbour steps that tied embeddings create (OPT's lm_head)."""
    n = len(dom)
    adj0 = [set() for _ in range(n)]
    for vs in scopes:
        for a in vs:
            adj0[a].update(v for v in vs if v != a)

    def fewest_neighbours(v, adj):
        return (len(adj[v]), math.prod(dom[o] for o in adj[v]), v)

    def least_fill(v, adj):
        nb = sorted(adj[v])
        fill = sum(dom[a] * dom[b] for i, a in enumerate(nb) for b in nb[i + 1:] if b not in adj[a])
        return (fill, dom[v] * math.prod(dom[o] for o in nb), v)

    best = None
    for rule in (fewest_neighbours, least_fill):
        adj = [set(a) for a in adj0]
        keys = {v: rule(v, adj) for v in range(n)}  # only a step's neighbours change
        order, work = [], 0
        while keys:
            x = min(keys, key=keys.__getitem__)
            nb = adj[x]
            work += dom[x] * math.prod(dom[o] for o in nb)
            for a in nb:
                adj[a] |= nb - {a}
                adj[a].discard(x)
            del keys[x]
            order.append(x)
            for v in {w for a in nb for w in adj[a]} | nb:  # neighbours and theirs (fill)
                if v in keys:
                    keys[v] = rule(v, adj)
        if best is None or work < best[0]:
            best = (work, order)
    return best[1]


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
    size = math.prod(dom[v] for v in others)
    if size > max_table:
        raise TooWide(f"eliminating group {x} needs a table of {size} entries")
    if len(others) == 3:
        plan = _three_plan(x, fs, others, dom)
        if plan:
            return plan[1]()
    return _dense(x, fs, others, dom, max_table)


def _three_plan(x, fs, others, dom):
    """Three neighbours: two ways to reduce the step to two-neighbour steps, the one of
    smaller estimate; (estimate, compute) or None when neither applies."""
    plans = [p for p in (_split_plan(x, fs, others, dom), _fixing_plan(x, fs, others, dom)) if p]
    return min(plans, key=lambda p: p[0]) if plans else None


# Work of a step is counted in (min, +) entries; one numpy round of the fixing loop
# costs about as much as this many entries (measured: ~0.2 ms).
_ROUND = 200_000


def _split_plan(x, fs, others, dom):
    """Three neighbours that fall into two sides no factor spans, {a, b} and {c}: the
    pair is one neighbour with dom[a] * dom[b] choices, and the step is a single
    two-neighbour (min, +) step. (estimate, compute), or None when every split is spanned."""
    for c in sorted(others, key=lambda v: (-dom[v], v)):  # the largest alone: the pair side stays small
        pair = [v for v in others if v != c]
        if any(c in vs and len(vs) > 2 for vs, _ in fs):
            continue
        u = np.zeros(dom[x], dtype=np.int64)
        left = np.zeros((dom[x], dom[pair[0]], dom[pair[1]]), dtype=np.int64)
        right = np.zeros((dom[x], dom[c]), dtype=np.int64)
        for vs, t in fs:
            t = np.moveaxis(t, vs.index(x), 0)
            rest = [v for v in vs if v != x]
            if not rest:
                u = u + t
            elif rest == [c]:
                right += t
            else:  # over x and one or both of the pair, axes in sorted order
                left += t.reshape([dom[x]] + [dom[v] if v in rest else 1 for v in pair])
        left = left.reshape(dom[x], -1)
        lc, rc = _row_classes(left), _row_classes(right)

        def compute():
            r = _min_plus_two(u, left, right, lc, rc)   # (pair choices, c choices)
            axes = pair + [c]
            return np.transpose(r.reshape(dom[pair[0]], dom[pair[1]], dom[c]), [axes.index(v) for v in others])
        return min(len(lc[0]), len(rc[0])) * left.shape[1] * dom[c], compute
    return None


def _fixing_plan(x, fs, others, dom):
    """Three neighbours: fix the one with the fewest choices, a; for each of its values
    the rest is a two-neighbour step (``_min_plus_two``). Needs every factor on x to
    hold at most one neighbour besides a. (estimate, compute), or None."""
    a = min(others, key=lambda v: (dom[v], v))
    rest_vars = [v for v in others if v != a]
    if any(len([v for v in vs if v not in (x, a)]) > 1 for vs, _ in fs):
        return None
    # parts that do not depend on a's value, and the factors that do
    u0 = np.zeros(dom[x], dtype=np.int64)
    m0 = {o: np.zeros((dom[x], dom[o]), dtype=np.int64) for o in rest_vars}
    with_a = []
    for vs, t in fs:
        if a in vs:
            with_a.append((vs, t))
        elif len(vs) == 1:
            u0 = u0 + t
        else:
            o = vs[0] if vs[1] == x else vs[1]
            m0[o] = m0[o] + (t if vs[0] == x else t.T)
    static = {o for o in rest_vars if not any(o in vs for vs, _ in with_a)}
    classes = {o: _row_classes(m0[o]) for o in static}
    b, c = rest_vars
    rows = min([len(classes[o][0]) for o in static], default=dom[x])

    def compute():
        out = np.empty([dom[a]] + [dom[o] for o in rest_vars], dtype=np.int64)
        for val in range(dom[a]):
            u, m = u0, dict(m0)
            for vs, t in with_a:
                t = np.take(t, val, axis=vs.index(a))
                rest = tuple(v for v in vs if v != a)
                if len(rest) == 1:
                    u = u + t
                else:
                    o = rest[0] if rest[1] == x else rest[1]
                    m[o] = m[o] + (t if rest[0] == x else t.T)
            out[val] = _min_plus_two(u, m[b], m[c], classes.get(b), classes.get(c))
        # out's axes are (a, *rest); the factor's axes go in the sorted order of others
        axes = [a] + rest_vars
        return np.transpose(out, [axes.index(v) for v in others])
    return dom[a] * (rows * dom[b] * dom[c] + _ROUND), compute


def _min_plus_two(u, a, b, a_classes=None, b_classes=None):
    """R[i, j] = min_x u[x] + a[x, i] + b[x, j], over the classes of x's rows of a.

    With p the class of x's row of a: h[p, j] = min over x in class p of u[x] + b[x, j]
    (a segmented minimum), then R[i, j] = min_p a_p[i] + h[p, j], a (min, +) product
    over the classes only; a and b swap roles when b has fewer distinct rows.
    ``*_classes``: the rows' classes when the caller already has them."""
    ra, ca = a_classes or _row_classes(a)
    rb, cb = b_classes or _row_classes(b)
    if len(rb) < len(ra):
        return _min_plus_two_classes(u, rb, cb, a).T
    return _min_plus_two_classes(u, ra, ca, b)


def _min_plus_two_classes(u, ra, ca, b):
    order = np.argsort(ca, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(ca[order]) != 0])
    h = np.minimum.reduceat(u[order, None] + b[order], starts, axis=0)   # (P, J), class order
    # Neighbour choices with equal columns get equal rows (columns) of R: compute
    # R once per distinct column and expand.
    ci, ii = _row_classes(ra.T)   # (I', P): distinct columns of ra
    cj, jj = _row_classes(h.T)    # (J', P)
    return _min_plus(ci, cj.T)[ii][:, jj]


def _min_plus(x, y):
    """C[i, j] = min_k x[i, k] + y[k, j], a tile of rows at a time: the working set stays
    a cache-sized (rows x K x J) temporary instead of an I x K x J one."""
    y = np.ascontiguousarray(y)  # (a transposed view here would make every tile strided)
    rows = max(1, _BLOCK // max(1, x.shape[1] * y.shape[1]))
    if rows >= x.shape[0]:
        return (x[:, :, None] + y[None]).min(axis=1)
    out = np.empty((x.shape[0], y.shape[1]), dtype=np.int64)
    for i in range(0, x.shape[0], rows):
        np.min(x[i:i + rows, :, None] + y[None], axis=1, out=out[i:i + rows])
    return out


_BLOCK = 1 << 17  # elements of one (min, +) block: 1 MiB of int64


def _row_classes(m):
    """(distinct rows of m in first-seen order, index of each row's class).

    Rows are bucketed by a random 64-bit projection (one matrix product), then every
    row is checked equal to its bucket's first row; only if some bucket mixes rows
    (a hash collision) are the rows' bytes hashed instead. Exact either way."""
    m = np.ascontiguousarray(m)
    if m.shape[0] == 0:
        return m, np.zeros(0, dtype=np.intp)
    h = m.view(np.uint64) @ _projection(m.shape[1]) if m.dtype == np.int64 else None
    if h is not None:
        _, first, inv = np.unique(h, return_index=True, return_inverse=True)
        if np.array_equal(m, m[first][inv]):
            order = np.argsort(first, kind="stable")      # classes in first-seen order
            rank = np.empty_like(order)
            rank[order] = np.arange(len(order))
            return m[first[order]], rank[inv].reshape(-1)
    seen: dict[bytes, int] = {}
    inv = np.fromiter((seen.setdefault(r.tobytes(), len(seen)) for r in m), dtype=np.intp, count=len(m))
    first = np.zeros(len(seen), dtype=np.intp)
    first[inv[::-1]] = np.arange(len(m) - 1, -1, -1)
    return m[first], inv


_PROJECTION = np.random.default_rng(0).integers(1, 2**63, size=1024, dtype=np.uint64) | np.uint64(1)


def _projection(n: int) -> np.ndarray:
    """A pseudo-random uint64 vector of length n. It only buckets rows: classes are
    checked exactly and numbered in first-seen order, so no result depends on it."""
    global _PROJECTION
    if n > len(_PROJECTION):  # (rare: rows wider than any seen so far)
        more = np.random.default_rng(n).integers(1, 2**63, size=n - len(_PROJECTION), dtype=np.uint64)
        _PROJECTION = np.concatenate([_PROJECTION, more | np.uint64(1)])
    return _PROJECTION[:n]


def _dense(x, fs, others, dom, max_table):
    """Three or more neighbours: accumulate the minimum over x one choice at a time,
    so memory stays at the size of the result table."""
    size = math.prod(dom[v] for v in others)
    if size * dom[x] > 50 * max_table:
        raise TooWide(f"eliminating group {x} needs {size} x {dom[x]} steps")
    shape = [dom[v] for v in others]
    # each factor with x's axis first (a view), laid out to broadcast over others
    placed = [(np.moveaxis(t, vs.index(x), 0), [dom[v] if v in vs else 1 for v in others]) for vs, t in fs]
    out = np.empty(shape, dtype=np.int64)
    acc = np.empty(shape, dtype=np.int64)
    for i in range(dom[x]):
        acc.fill(0)
        for t, sh in placed:
            acc += t[i].reshape(sh)  # vs and others both sorted: axes line up
        if i == 0:
            out[...] = acc
        else:
            np.minimum(out, acc, out=out)
    return out


__all__ = ["eliminate", "elimination_order", "TooWide"]
