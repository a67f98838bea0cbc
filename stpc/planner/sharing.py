"""sharing: one producer's reshard paid once, however many consumers read it.

When several decision nodes read one tensor in the same placement (Megatron's
sequence-parallel all-gather of the norm output before q, k and v; before gate and
up), the passes emit the same reshard for each consumer and ``passes.cleanup`` merges
identical calls into one collective, forward and backward (the consumers' gradients
add up before the one backward collective). So those edges cost a sum over the
*distinct* placements the consumers need, not over the consumers:

    share cost = sum over distinct keys K among the consumers' choices of c(P, K)

P is the producer's choice (its class: a row of ``Share.cost``); a consumer's key is
the placement it reads the operand in together with the mesh axes it splits its work
over, since both decide the reshard the passes emit and only identical calls merge.
Two consumers merged at run time on a common prefix of their per-axis steps only are
charged twice here (an upper bound of what runs).

The cost couples the producer with all its consumers, so it is not a pairwise term:

* ``Problem.evaluate`` and CP-SAT (:func:`add_to_cpsat`) use it as it is: per key, the
  first consumer that picks it pays for it;
* variable elimination (:func:`reduce`) needs a star: besides the producer, each
  consumer touches only leaf groups (its parameters) and at most one other group S, the
  same for all (q, k, v -> attention; gate, up -> their product). Eliminating the
  consumers together leaves a pair factor on (producer, S) (a consumer with no factor on S
  takes part as one whose factor is 0):

      F(P, s) = min over partitions pi of the consumers of
                sum over blocks B of pi of  min_K [c(P, K) + sum_{i in B} h_i(K, s)]

  where h_i(K, s) is consumer i's best cost (its own cost, its leaves', its factor with
  S) among its choices with key K. Exact: the partition of the consumers into groups of
  equal keys attains the true cost, and every (partition, keys) costs at least the true
  cost of the keys it picks (c >= 0: two blocks that pick one key pay it twice). Keys
  whose cost is the same for every P are interchangeable inside a block, so each block
  is one (min, +) product over those cost classes. Up to four consumers (15 partitions).

Shares that are not stars make the elimination raise ``TooWide`` (CP-SAT then solves
the problem exactly); the analysis forms only star-shaped shares.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stpc.planner.elimination import TooWide, _min_plus, _row_classes, _segment_min

MAX_CONSUMERS = 4  # set partitions to enumerate: 2, 5, 15 for 2, 3, 4 consumers


@dataclass
class Share:
    """Consumers ``vs`` read one tensor of producer ``u``; per distinct key they pick, the
    reshard from the producer's class costs ``cost[ucls[choice of u], key]`` ns, once.

    ``axes`` is the same cost as a sum over mesh axes, each a small class table
    ``(u choice -> class, key -> class, table)``: ``cost[ucls[c], K] == sum over axes of
    table[uc[c], kc[K]]`` exactly (CP-SAT's encoding is per axis). Left empty, it is the
    one-axis form of ``cost``."""

    u: int
    vs: tuple[int, ...]
    ucls: np.ndarray            # producer choice -> row of ``cost``
    keys: tuple[np.ndarray, ...]  # per consumer: choice -> key (column of ``cost``)
    cost: np.ndarray            # (rows, keys) int64 ns, >= 0
    axes: list = field(default_factory=list)

    def __post_init__(self):
        self.ucls = np.asarray(self.ucls, dtype=np.intp)
        self.keys = tuple(np.asarray(k, dtype=np.intp) for k in self.keys)
        self.cost = np.asarray(self.cost, dtype=np.int64)
        if not self.axes:
            self.axes = [(self.ucls, np.arange(self.cost.shape[1]), self.cost)]

    def value(self, choice) -> int:
        row = self.cost[self.ucls[choice[self.u]]]
        return int(sum(row[k] for k in {int(ks[choice[v]]) for v, ks in zip(self.vs, self.keys)}))


def partitions(k: int) -> list[list[tuple[int, ...]]]:
    """Every set partition of range(k), each a list of blocks."""
    out = [[]]
    for i in range(k):
        out = [p[:j] + [p[j] + (i,)] + p[j + 1:] for p in out for j in range(len(p))] + [p + [(i,)] for p in out]
    return out


_PARTITIONS = {k: partitions(k) for k in range(1, MAX_CONSUMERS + 1)}


def add_to_cpsat(m, x, share: Share, tag: str) -> list:
    """Objective terms of ``share`` in a CP-SAT model whose group g takes choice c when
    ``x[g][c]`` (``x[g]`` None: a group with one choice).

    Per key K, the first consumer (in ``share.vs`` order) that picks it pays for it: the
    first consumer always pays for its own key; consumer i > 0 pays for K when
    ``pay[i, K] >= [i picks K] - sum_{j < i} [j picks K]`` (with ``pay[i, K] <= [i picks K]``;
    minimisation keeps it at that bound). Each consumer's payment is then an ordinary
    edge from the producer to "the key it pays for, or none", one transport
    linearisation per axis as ``solver`` encodes edges. The payer is fixed, so no two
    solutions differ only in who pays (letting any user of a key pay made CP-SAT
    explore those permutations: 25x slower on llama-tiny)."""
    def picks(g, cls, value):  # linear expression: group g takes a choice whose class is value
        idx = np.flatnonzero(cls == value)
        if x[g] is None:
            return int(idx.size > 0 and idx[0] == 0)
        return sum(x[g][int(c)] for c in idx)

    paid = [k for k in range(share.cost.shape[1]) if share.cost[:, k].any()]
    pays = []  # per consumer: {key: linear expression, 1 when it pays for that key}
    for i, (v, ks) in enumerate(zip(share.vs, share.keys)):
        mine = {}
        for k in paid:
            if not (ks == k).any():
                continue
            p = picks(v, ks, k)
            if i == 0:
                mine[k] = p
                continue
            earlier = [picks(u, kk, k) for u, kk in zip(share.vs[:i], share.keys[:i]) if (kk == k).any()]
            if not earlier:
                mine[k] = p
                continue
            var = m.NewBoolVar(f"pay{tag}_{i}_{k}")
            m.Add(var <= p)
            m.Add(var >= p - sum(earlier))
            mine[k] = var
        pays.append(mine)
    terms = []
    for i, mine in enumerate(pays):
        if not mine:
            continue
        none = 1 - sum(mine.values())  # pays for no key
        for a, (uc, kc, table) in enumerate(share.axes):
            if not table.any():
                continue
            cols = {}  # the axis class of a key -> what consumer i pays for in it
            for k, var in mine.items():
                cols.setdefault(int(kc[k]), []).append(var)
            if x[share.u] is None:  # the producer is fixed: the payment is linear in ``mine``
                p0 = int(uc[0])
                terms += [int(table[p0, q]) * var for q, vs in cols.items() for var in vs if table[p0, q]]
                continue
            rows = {}
            for c in range(len(uc)):
                rows.setdefault(int(uc[c]), []).append(x[share.u][c])
            e = {(p, q): m.NewBoolVar(f"pe{tag}_{i}_{a}_{p}_{q}") for p in rows for q in [*cols, None]}
            for p, xs in rows.items():
                m.Add(sum(e[p, q] for q in [*cols, None]) == sum(xs))
            for q, vs in cols.items():
                m.Add(sum(e[p, q] for p in rows) == sum(vs))
            m.Add(sum(e[p, None] for p in rows) == none)
            terms += [int(table[p, q]) * e[p, q] for p in rows for q in cols if table[p, q]]
    return terms


def reduce(unary: list[np.ndarray], pairs: dict, shares: list[Share], scale: int):
    """Eliminate every share's consumers (and their leaf groups) into a pair factor on
    (producer, S) (see the module docstring), in place on ``unary`` and ``pairs`` (the
    forms ``elimination.eliminate`` takes). Returns ``back(choice)``, which sets the
    removed groups' choices once the rest is chosen. Raises ``TooWide`` for a share that
    is not a star (CP-SAT solves those)."""
    owner: dict[int, int] = {}
    for i, sh in enumerate(shares):
        groups = (sh.u, *sh.vs)
        if len(set(groups)) != len(groups) or len(sh.vs) > MAX_CONSUMERS or any(g in owner for g in groups):
            raise TooWide("shares overlap, or a share has a repeated or too many consumers")
        owner.update((g, i) for g in groups)
    steps = [_reduce_one(unary, pairs, sh, scale) for sh in shares]

    def back(choice):
        for step in reversed(steps):
            step(choice)
    return back


def _neighbours(pairs) -> dict[int, set]:
    nb: dict[int, set] = {}
    for a, b in pairs:
        nb.setdefault(a, set()).add(b)
        nb.setdefault(b, set()).add(a)
    return nb


def _dense(pairs, a, b, da, db) -> np.ndarray:
    """The (a-choices x b-choices) sum of the class tables between a and b; removes them."""
    key, flip = ((a, b), False) if a < b else ((b, a), True)
    tot = np.zeros((db, da) if flip else (da, db), dtype=np.int64)
    for ca, cb, t in pairs.pop(key):
        m = t
        if ca is not None:
            m = np.take(m, ca, axis=0)
        if cb is not None:
            m = np.take(m, cb, axis=1)
        tot += m
    return tot.T if flip else tot


def _reduce_one(unary, pairs, sh: Share, scale: int):
    nb = _neighbours(pairs)
    dom = [len(u) for u in unary]
    consumers = list(sh.vs)
    leaves, others = {}, []
    for v in consumers:
        mine = nb.get(v, set())
        leaves[v] = sorted(g for g in mine if nb.get(g) == {v} and g != sh.u and g not in consumers)
        others.append(frozenset(mine) - set(leaves[v]))
    common = frozenset().union(*others)  # (a consumer whose factor with S costs nothing has none)
    if len(common) > 1 or common & {sh.u, *consumers}:
        raise TooWide("a share whose consumers are not a star (one common neighbour besides the producer)")
    (s,) = common or (None,)
    folded = [_fold_leaves(unary, pairs, v, leaves[v], dom) for v in consumers]
    f = [_dense(pairs, v, s, dom[v], dom[s]) if s in nb.get(v, ()) else
         np.zeros((dom[v], 1 if s is None else dom[s]), dtype=np.int64) for v in consumers]
    # S's choices alike for every consumer share a class (columns of the stacked factors);
    # each consumer alone sees fewer classes of S (its own factor's columns), and a block
    # of consumers the classes of its members' columns together.
    if s is not None:
        _, scls = _row_classes(np.vstack(f).T)
        first = _first_of(scls, int(scls.max()) + 1)
        own = [_row_classes(fv.T)[1] for fv in f]            # per consumer: S choice -> its class
        jmap = [o[first] for o in own]                      # per consumer: joint class -> its class
        f_own = [fv[:, _first_of(o, int(o.max()) + 1)] for fv, o in zip(f, own)]
        f = [fv[:, first] for fv in f]
    else:
        scls = None
        jmap = [np.zeros(1, dtype=np.intp) for _ in f]
        f_own = f
    cost = sh.cost * scale
    total, rcls = _star_factor(cost, [unary[v] for v in consumers], f_own, jmap, sh.keys)
    ucls = rcls[np.asarray(sh.ucls)]
    if s is None:
        unary[sh.u] = unary[sh.u] + total[ucls, 0]
    elif sh.u < s:
        pairs.setdefault((sh.u, s), []).append((ucls, scls, total))
    else:
        pairs.setdefault((s, sh.u), []).append((scls, ucls, total.T))
    own_unary = [unary[v] for v in consumers]
    for v in consumers:
        unary[v] = np.zeros(dom[v], dtype=np.int64)

    def back(choice):
        """The consumers' (and their leaves') choices, the producer and S chosen: the
        formula again at that point, keeping the partition and keys that attain it."""
        row = cost[sh.ucls[choice[sh.u]]]
        col = 0 if s is None else scls[choice[s]]
        best = [_best_by_key(u + fv[:, col], ks, cost.shape[1]) for u, fv, ks in zip(own_unary, f, sh.keys)]
        pick = None
        for part in _PARTITIONS[len(consumers)]:
            value, keys = 0, []
            for block in part:
                v = row + sum(best[i][0] for i in block)
                kk = int(np.argmin(v))
                value += int(v[kk])
                keys.append(kk)
            if pick is None or value < pick[0]:
                pick = (value, part, keys)
        _, part, keys = pick
        for block, kk in zip(part, keys):
            for i in block:
                choice[consumers[i]] = int(best[i][1][kk])
        for v, own in zip(consumers, folded):
            for g, best_g in own:
                choice[g] = int(best_g[choice[v]])
    return back


def _fold_leaves(unary, pairs, v, leaves, dom) -> list:
    """Fold leaf groups (touching only v) into v's unary; returns [(leaf, its best choice
    per choice of v)] for the back-substitution."""
    folded = []
    for g in leaves:
        t = unary[g][:, None] + _dense(pairs, g, v, dom[g], dom[v])
        folded.append((g, t.argmin(axis=0)))
        unary[v] = unary[v] + t.min(axis=0)
        unary[g] = np.zeros(dom[g], dtype=np.int64)
    return folded


def _star_factor(cost, unary, f, jmap, keys) -> tuple[np.ndarray, np.ndarray]:
    """(F over (producer class, joint S class), the producer class of each row of ``cost``)
    for the F of the module docstring: per block of consumers
    one (min, +) product of the producer's cost to each key class with the block's best
    costs per key, then per partition the sum of its blocks, the minimum over partitions.
    ``f[i]``: consumer i's factor with S over its own S classes, ``jmap[i]`` the joint S
    class -> its own."""
    rows, rcls = _row_classes(cost)          # producer choices with equal cost rows
    kcols, kcls = _row_classes(cost.T)       # keys with equal cost columns: one cost class
    rows_k = rows[:, _first_of(kcls, len(kcols))]  # (producer classes x key cost classes)
    h, present = [], []                      # per consumer: best per key and own S class; keys it has
    for u, fv, ks in zip(unary, f, keys):
        keys_present, best = _segment_min(u[:, None] + fv, np.asarray(ks))
        full = np.zeros((cost.shape[1], fv.shape[1]), dtype=np.int64)
        full[keys_present] = best
        mask = np.zeros(cost.shape[1], dtype=bool)
        mask[keys_present] = True
        h.append(full)
        present.append(mask)
    k = len(unary)
    # Consumers alike (equal best costs per key and S class: q and k before attention) make
    # blocks alike: one product per multiset of alike consumers.
    alike = [next(j for j in range(i + 1) if np.array_equal(jmap[j], jmap[i]) and np.array_equal(h[j], h[i]))
             for i in range(k)]
    block_val, by_kind = {}, {}
    for part in _PARTITIONS[k]:
        for b in part:
            if b in block_val:
                continue
            kind = tuple(sorted(alike[i] for i in b))
            if kind not in by_kind:
                mask = np.logical_and.reduce([present[i] for i in b])
                if not mask.any():  # no key every member can read
                    by_kind[kind] = None
                else:
                    bcls, reps = _classes_of(np.stack([jmap[i] for i in b], axis=1))  # joint -> block's S class
                    hb = sum(h[i][:, reps[:, j]] for j, i in enumerate(b))
                    cls_present, hbc = _segment_min(hb[mask], kcls[mask])
                    by_kind[kind] = _min_plus(rows_k[:, cls_present], hbc)[:, bcls]  # (rows x joint S)
            block_val[b] = by_kind[kind]
    total = None
    for part in _PARTITIONS[k]:
        if any(block_val[b] is None for b in part):
            continue
        t = sum(block_val[b] for b in part)
        total = t if total is None else np.minimum(total, t)
    return total, rcls


def _best_by_key(val: np.ndarray, ks: np.ndarray, nkeys: int) -> tuple[np.ndarray, np.ndarray]:
    """(per key: the least value among the choices with that key, a choice attaining it);
    keys no choice has get a value far above any sum of costs."""
    order = np.lexsort((val, ks))  # by key, then value: first of each key is its best
    starts = np.flatnonzero(np.r_[True, ks[order][1:] != ks[order][:-1]])
    best = np.full(nkeys, np.iinfo(np.int64).max // 8, dtype=np.int64)
    arg = np.full(nkeys, -1, dtype=np.intp)
    best[ks[order][starts]] = val[order][starts]
    arg[ks[order][starts]] = order[starts]
    return best, arg


def _classes_of(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(class per row, the distinct rows) of a matrix of small non-negative ints: rows
    that are equal share a class (one int key per row: faster than a row-wise unique)."""
    key = np.zeros(len(rows), dtype=np.int64)
    for col in rows.T:
        key = key * (int(col.max()) + 1) + col
    _, first, cls = np.unique(key, return_index=True, return_inverse=True)
    return cls.reshape(-1), rows[first]


def _first_of(cls: np.ndarray, n: int) -> np.ndarray:
    """A representative (the first member) of each of ``n`` classes."""
    first = np.zeros(n, dtype=np.intp)
    first[cls[::-1]] = np.arange(len(cls) - 1, -1, -1)
    return first


__all__ = ["Share", "add_to_cpsat", "reduce", "partitions", "MAX_CONSUMERS"]
