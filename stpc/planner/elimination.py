"""eliminate: the exact minimum of a sum of unary and pairwise costs, by variable elimination.

The solver's problem without its memory rows is a min-sum factor graph: one
cost vector per group and one cost matrix per pair of groups joined by edges.
A transformer's tied problem has tree width 2 (the residual stream closes one
cycle per block), so eliminating one group at a time leaves factors of at most
two groups, and the exact optimum costs a few small (min, +) products instead
of a CP-SAT search.

Eliminating group x with neighbours a and b:
    R[a, b] = min_x U[x] + A[x, a] + B[x, b]
Many choices look alike to an edge (a per-axis edge only sees the token on its
axis), so every pair factor is a small table indexed by the classes of its two
ends, as the edges come (the choice-by-choice matrix is never written). Several
tables on one side meet in their joint classes; x's choices are grouped by their
class on A's side: a segmented minimum of U + B over each class, then one
(min, +) product over the classes, for the classes of a and of b. R is again a
class table.

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


def eliminate(unary: list[np.ndarray], pairs: dict[tuple[int, int], object],
              max_table: int = 4_000_000) -> tuple[int, list[int]]:
    """Minimise ``sum_g unary[g][c_g] + sum_(a,b) pairs[a,b][c_a, c_b]`` exactly.

    ``pairs`` is keyed by ``(a, b)`` with ``a < b``; each value is a matrix
    ``len(unary[a]) x len(unary[b])`` or a list of class tables ``(a's class per
    choice, b's class per choice, table)`` whose entries add up, the form edges come
    in (the matrix is never written). Returns ``(minimum, choice per group)``.
    """
    n = len(unary)
    dom = [len(u) for u in unary]
    unary = [np.asarray(u, dtype=np.int64) for u in unary]
    factors: dict[tuple[int, ...], list[_Factor]] = {}  # scope (sorted groups) -> tables that add up
    for (a, b), m in pairs.items():
        if isinstance(m, list) and m and isinstance(m[0], tuple):
            factors[(a, b)] = [_Factor((np.asarray(ca, dtype=np.intp), np.asarray(cb, dtype=np.intp)),
                                       np.asarray(t, dtype=np.int64)) for ca, cb, t in m]
        else:
            factors[(a, b)] = [_Factor((None, None), np.asarray(m, dtype=np.int64))]
    touching: list[set] = [set() for _ in range(n)]
    for vs in factors:
        for v in vs:
            touching[v].add(vs)

    def dense_fs(y):  # y's unary and its factors as dense tables, one per scope
        return [((y,), unary[y])] + [(vs, sum(f.dense() for f in factors[vs])) for vs in sorted(touching[y])]

    eliminated: list[tuple[int, np.ndarray, list[tuple[tuple[int, ...], _Factor]]]] = []
    total = 0
    order = elimination_order(list(factors), dom)
    i = 0
    while i < len(order):
        x, plan = _pick(order, i, dense_fs, touching, dom, max_table)
        if x != order[i]:  # a tie went the other way: the greedy order continues from here
            done = set(order[:i]) | {x}
            scopes = [vs for vs in factors if x not in vs]
            scopes.append(tuple(sorted({v for vs in touching[x] for v in vs if v != x})))
            order = order[:i] + [x] + [v for v in elimination_order(scopes, dom) if v not in done]
        i += 1
        others = tuple(sorted({v for vs in touching[x] for v in vs if v != x}))
        two_way = len(others) <= 2 and all(len(vs) == 2 for vs in touching[x])
        if plan is None and not two_way:
            fs_dense = dense_fs(x)
        fs = [(vs, f) for vs in sorted(touching[x]) for f in factors.pop(vs)]
        for vs, _ in fs:
            for v in vs:
                if v != x:
                    touching[v].discard(vs)
        touching[x].clear()
        eliminated.append((x, unary[x], fs))
        if plan is not None:
            out = _Factor((None,) * len(others), plan[1]())
        elif two_way:
            out = _class_step(x, unary[x], fs, others, dom)
        else:
            out = _Factor((None,) * len(others), _min_out(x, fs_dense, others, dom, max_table))
        if not others:
            total += int(out.table)
        elif len(others) == 1:
            unary[others[0]] = unary[others[0]] + out.dense()
        else:
            factors.setdefault(others, []).append(out)
            for v in others:
                touching[v].add(others)
    choice = [0] * n
    for x, u, fs in reversed(eliminated):  # back-substitute: neighbours are already chosen
        val = u
        for vs, f in fs:
            idx = []
            for v, c in zip(vs, f.cls):
                if v == x:
                    idx.append(slice(None) if c is None else c)
                else:
                    idx.append(choice[v] if c is None else c[choice[v]])
            val = val + f.table[tuple(idx)]
        choice[x] = int(np.argmin(val))
    return total, choice


class _Factor:
    """A cost table over a scope of groups, indexed per group by the class of its
    choice: value(c_1, ..., c_k) = table[cls_1[c_1], ..., cls_k[c_k]]; a None class map
    is the identity. An edge sees few classes of its ends (a per-axis edge, one token
    per axis), so its table stays small and the choice-by-choice matrix is not built."""

    __slots__ = ("cls", "table")

    def __init__(self, cls: tuple, table: np.ndarray):
        self.cls, self.table = cls, table

    def dense(self) -> np.ndarray:
        t = self.table
        for axis, c in enumerate(self.cls):
            if c is not None:
                t = np.take(t, c, axis=axis)
        return t


def _class_step(x, u, fs, others, dom) -> _Factor:
    """Eliminate x when every factor on it is a pair, with at most two neighbours,
    working on classes: per side, the joint classes of x and of the neighbour over that
    side's tables; the minimum over x runs over the classes of one side (a segmented
    minimum of u plus the other side's table), then a (min, +) product over them."""
    sides: dict[int, list] = {o: [] for o in others}
    for vs, f in fs:
        if vs[0] == x:
            sides[vs[1]].append((f.cls[0], f.cls[1], f.table))
        else:
            sides[vs[0]].append((f.cls[1], f.cls[0], f.table.T))
    if not others:
        return _Factor((), u.min())
    if dom[x] * math.prod(dom[o] for o in others) <= _DENSE_STEP:  # small: one dense broadcast
        mats = [sum(_Factor((cx, co), t).dense() for cx, co, t in sides[o]) for o in others]
        if len(mats) == 1:
            return _Factor((None,), (u[:, None] + mats[0]).min(axis=0))
        return _Factor((None, None), (mats[0][:, :, None] + mats[1][:, None, :] + u[:, None, None]).min(axis=0))
    side = {o: _side(parts, dom[x], dom[o]) for o, parts in sides.items()}
    if len(others) == 1:
        (o,) = others
        jx, jo, t = side[o]
        present, h = _segment_min(u[:, None], jx)
        return _Factor((jo,), (h + t[present]).min(axis=0))
    a, b = sorted(others, key=lambda o: _num_classes(side[o][0], dom[x]))  # rows: fewer x classes
    jxa, joa, ta = side[a]
    jxb, job, tb = side[b]
    present, h = _segment_min(u[:, None] + (tb if jxb is None else tb[jxb]), jxa)  # (x classes of a, b's)
    r = _min_plus(np.ascontiguousarray(ta[present].T), h)                              # (a's classes, b's)
    return _Factor((joa, job), r) if a < b else _Factor((job, joa), r.T)


def _side(parts, dx, do):
    """(x's class per choice, the neighbour's, table over them) of one side's tables:
    the joint classes when several tables meet there."""
    if len(parts) == 1:
        return parts[0]
    jx, rx = _joint_classes([p[0] for p in parts], dx)
    jo, ro = _joint_classes([p[1] for p in parts], do)
    t = sum(tt[np.ix_(_at(cx, rx, dx), _at(co, ro, do))] for cx, co, tt in parts)
    return jx, jo, t


def _at(cls, rep, d):
    """The classes (table indices) of the representative choices ``rep`` (None: all)."""
    if rep is None:
        return np.arange(d) if cls is None else cls
    return rep if cls is None else cls[rep]


def _joint_classes(maps, d):
    """(joint class per choice, a representative choice per joint class) of choices that
    share a class in every map; (None, None) when some map is the identity."""
    if any(m is None for m in maps):
        return None, None
    key = maps[0]
    for m in maps[1:]:
        key = key * (int(m.max()) + 1) + m
        if int(key.max()) > 1 << 40:  # keep the combined key small
            key = np.unique(key, return_inverse=True)[1].reshape(-1)
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return inv.reshape(-1), first


def _num_classes(cls, d):
    return d if cls is None else int(cls.max()) + 1


def _segment_min(m, cls):
    """(the classes present, per class the row-wise minimum of m over its rows)."""
    if cls is None:
        return slice(None), m
    order = np.argsort(cls, kind="stable")
    sc = cls[order]
    starts = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1]])
    return sc[starts], np.minimum.reduceat(m[order], starts, axis=0)


def _pick(order, i, dense_fs, touching, dom, max_table):
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
        return _three_plan(y, dense_fs(y), others, dom)

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
    """The dense table over ``others`` of min over x of the sum of the dense factors
    ``fs``: the steps :func:`_class_step` does not take (three or more neighbours, or a
    factor over three groups)."""
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
    ``*_classes``: the rows' classes when the caller already has them. A small step is
    one dense broadcast: finding classes costs ~0.1 ms, more than it would save."""
    if len(u) * a.shape[1] * b.shape[1] <= _DENSE_STEP:
        return (a[:, :, None] + b[:, None, :] + u[:, None, None]).min(axis=0)
    ra, ca = a_classes or _row_classes(a)
    rb, cb = b_classes or _row_classes(b)
    if len(rb) < len(ra):
        return _min_plus_two_classes(u, rb, cb, a).T
    return _min_plus_two_classes(u, ra, ca, b)


_DENSE_STEP = 65_536  # entries (x, i, j) of a step scanned densely (~0.1 ms, measured)


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
