"""lagrangian: a lower bound of a budgeted problem's optimum, from its memory rows relaxed.

For any lambda >= 0, ``min_x objective(x) + lambda * (M(x) - budget)`` is no more than the
objective of any assignment that fits the budget (there ``M(x) - budget <= 0``): a lower
bound of the budgeted optimum (Lagrangian relaxation of one memory phase, ``M`` any lower
bound of that phase's bytes). Read as unary and pairwise terms, the relaxed objective is
minimised exactly by variable elimination, as fast as the memory-blind optimum:

- a phase's per-choice rows are unary terms; its largest working set (a max over groups) is
  replaced by a constant below it (the largest of the groups' least) or, in a second try of
  the phase, by the working set of the one group largest at the memory-blind optimum (the
  max is at least that group's, whatever is chosen);
- its pairwise memory edges stay pairwise where a time edge already joins the two groups (or
  become unary where one end has one choice), and elsewhere are replaced by their least over
  the consumer's classes (so the elimination order, fixed by the time edges, still holds);
- coefficients ``lambda * bytes`` are rounded down, and one ns more, so float rounding can
  only lower the bound.

The bound is concave and piecewise linear in lambda, with slope ``M(x_lambda) - budget`` at
the minimiser ``x_lambda``. :func:`relax` brackets the best lambda geometrically, then
cuts the bracket at the two supporting lines' intersection (whose height bounds every
lambda's value from above: once it is at or below the cap, this relaxation cannot prove
anything and the search stops).

Where it pays: the search caps a candidate the budget binds on by the best plan so far
(``Problem.cap``); a bound above the cap proves that no plan of the candidate beats it
without CP-SAT's full model. bloom-7b1 on 8 V100s: three such candidates proven in 0.04-0.11 s
each, which the full model took 1.6-7.8 s to prove infeasible under the cap. And each
minimiser that fits the budget in truth is a plan in hand (:func:`relax`): the search caps
CP-SAT by it and keeps it where CP-SAT runs out of time (on that cell, the first
candidate's is already the optimum).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stpc.planner.elimination import TooWide
from stpc.planner.solver import Edge, Problem, solve_unconstrained


@dataclass
class Phase:
    """One memory phase as terms a lower bound of its bytes is the sum of: ``unary[g][c]``
    bytes per group and choice, ``edges`` (bytes per pair of classes) and ``const``."""

    name: str
    unary: list[np.ndarray]
    edges: list[Edge]
    const: int

    def magnitude(self) -> int:
        """An upper bound of any term's (or sum of terms') absolute bytes."""
        return (sum(int(np.abs(u).max(initial=0)) for u in self.unary) + abs(self.const)
                + sum(max(map(abs, e.table.values()), default=0) for e in self.edges) + 1)

    def bytes_at(self, choice: list[int]) -> int:
        """This lower bound of the phase's bytes under ``choice``."""
        out = self.const + sum(int(r[c]) for r, c in zip(self.unary, choice))
        return out + sum(e.table.get((e.ucls[choice[e.u]], e.vcls[choice[e.v]]), 0) for e in self.edges)


def phases(p: Problem, at: list[int] | None = None) -> list[Phase]:
    """Each memory phase of ``p`` (as ``Problem.phase_peaks`` sums them) as unary terms,
    pairwise terms on the pairs of groups ``p``'s time edges join, and a constant; for every
    assignment each is at most that phase's peak. The largest working set of a phase (a max
    over groups) is at least any one group's least: the constant. With an assignment ``at``,
    each such phase comes a second time with the working set of the group largest under
    ``at`` as that group's unary term instead (the max is at least any one group's own,
    whatever is chosen: stronger near ``at``)."""
    joined = {(min(e.u, e.v), max(e.u, e.v)) for e in p.edges if e.table}
    n = [len(c) for c in p.cost]

    def phase(name, rows, edges, most):
        unary = [np.zeros(k, dtype=np.int64) for k in n]
        for r in rows:
            if r is not None:
                for g, row in enumerate(r):
                    unary[g] += np.asarray(row, dtype=np.int64)
        kept = []
        for e in edges:
            if not e.table:
                continue
            if e.u != e.v and n[e.u] > 1 and n[e.v] > 1 and (min(e.u, e.v), max(e.u, e.v)) in joined:
                kept.append(e)
                continue
            t = np.zeros((max(e.ucls) + 1, max(e.vcls) + 1), dtype=np.int64)
            for (a, b), v in e.table.items():
                if a < t.shape[0] and b < t.shape[1]:
                    t[a, b] = v
            ucls, vcls = np.asarray(e.ucls), np.asarray(e.vcls)
            if e.u == e.v:
                unary[e.u] += t[ucls, vcls]
            elif n[e.v] == 1:
                unary[e.u] += t[ucls, vcls[0]]
            elif n[e.u] == 1:
                unary[e.v] += t[ucls[0], vcls]
            else:  # (no time edge here: its least over the consumer's classes, on the producer)
                unary[e.u] += t[ucls][:, np.unique(vcls)].min(axis=1)
        return Phase(name, unary, kept, most)

    def variants(name, rows, edges, working, incoming_edges=()):
        """The phase with its working-set max as a constant, and as the group largest at ``at``."""
        if working is None:
            return [phase(name, rows, edges, 0)]
        into = {}
        for e in incoming_edges:  # (a transient edge adds to its consumer's working set)
            into.setdefault(e.v, []).append(e)
        least = max((min(t) + sum(min(0, min(e.table.values(), default=0)) for e in into.get(g, ()))
                     for g, t in enumerate(working)), default=0)
        out = [phase(name, rows, edges, least)]
        if at is not None and working:
            own = [working[g][c] for g, c in enumerate(at)]
            for e in incoming_edges:
                own[e.v] += e.table.get((e.ucls[at[e.u]], e.vcls[at[e.v]]), 0)
            g = int(np.argmax(own))
            if own[g] > least:
                ws = [np.zeros(k, dtype=np.int64) for k in n]
                ws[g] = np.asarray(working[g], dtype=np.int64)
                out.append(phase(f"{name} (group {g}'s working set)", [*rows, ws], [*edges, *into.get(g, ())], 0))
        return out

    out = variants("end of forward", [p.mem], p.saved_edges, p.transient, p.transient_edges)
    if p.has_head_phase:
        out += variants("head's gradients", [p.mem, p.head_mem], [*p.head_edges, *p.saved_edges], None)
    if p.has_bwd_phase:
        out += variants("last layer's backward", [p.mem, p.bwd_mem], [*p.mem_edges, *p.saved_edges],
                        p.backward_transient)
    if p.has_step_phase:
        out += variants("optimizer step", [p.step_mem], [], p.step_transient)
    return out


def _floor_scaled(lam: float, a: np.ndarray) -> np.ndarray:
    """floor(lam * a) less 1 where a != 0: never above lam * a whatever the float rounding
    (its error stays under 1 while |lam * a| < 2**52)."""
    return np.floor(lam * a).astype(np.int64) - (a != 0)


def relaxed_minimum(p: Problem, ph: Phase, lam: float) -> tuple[int, list[int]]:
    """(a lower bound of the budgeted optimum, the assignment it is reached at): the minimum
    of ``objective + lam * (ph's bytes - budget)``, its coefficients rounded down."""
    cost = [np.asarray(c, dtype=np.int64) + _floor_scaled(lam, u) for c, u in zip(p.cost, ph.unary)]
    edges = list(p.edges)
    for e in ph.edges:
        keys = list(e.table)
        vals = _floor_scaled(lam, np.fromiter((e.table[k] for k in keys), dtype=np.int64, count=len(keys)))
        edges.append(Edge(e.u, e.v, e.ucls, e.vcls, dict(zip(keys, vals.tolist()))))
    choice = solve_unconstrained(Problem(cost=[c.tolist() for c in cost], edges=edges, shares=p.shares))
    value = sum(int(c[x]) for c, x in zip(cost, choice))
    value += sum(e.table.get((e.ucls[choice[e.u]], e.vcls[choice[e.v]]), 0) for e in edges)
    value += sum(s.value(choice) for s in p.shares)
    return value + math.floor(lam * (ph.const - p.budget)) - 1, choice


@dataclass
class Relaxation:
    """What :func:`relax` found: ``bound``, a lower bound of the budgeted optimum (None where
    none was computed), and the best relaxed minimiser that fits the budget in truth
    (``Problem.evaluate``), a plan in hand: ``choice``, its ``objective_ns`` and
    ``peak_bytes`` (None where no minimiser fitted). (The bound never proves that plan optimal alone: rounded down and
    less 1 ns, it lies strictly under every fitting assignment's objective.)"""

    bound: int | None
    choice: list[int] | None = None
    objective_ns: int | None = None
    peak_bytes: int | None = None


def relax(p: Problem, cap: int | None = None, at: list[int] | None = None, max_evals: int = 32) -> Relaxation:
    """The best Lagrangian lower bound of ``p``'s budgeted optimum found over its memory
    phases (each relaxed alone), stopping as soon as one exceeds ``cap`` (then no assignment
    that fits the budget costs ``cap`` or less) or once no lambda of any phase can. The bound is None
    where the graph is too wide to eliminate or ``p`` has no budget. At most ``max_evals``
    eliminations in all.

    Every minimiser is also checked against the true memory phases: a large enough lambda
    drives the relaxed phase under the budget, and its minimiser often fits in truth too,
    a plan for no more than its evaluation (the search's incumbent before CP-SAT runs)."""
    out = Relaxation(None)
    if p.budget is None:
        return out
    evals = 0
    scale = max(1, sum(max(c) for c in p.cost)) / max(1, p.budget)  # ns per byte, the step's over the budget's
    for ph in phases(p, at):
        lo, hi = None, None  # (lam, value, slope) with slope > 0 / <= 0
        lam = scale * 1e-3
        while evals < max_evals:
            try:
                value, choice = relaxed_minimum(p, ph, lam)
            except TooWide:
                return out
            evals += 1
            out.bound = value if out.bound is None else max(out.bound, value)
            obj, peak = p.evaluate(choice)
            if peak <= p.budget and (out.objective_ns is None or obj < out.objective_ns):
                out.choice, out.objective_ns, out.peak_bytes = choice, obj, peak
            if cap is not None and out.bound > cap:
                return out
            slope = ph.bytes_at(choice) - p.budget
            if slope > 0:
                lo = (lam, value, slope)
            else:
                hi = (lam, value, slope)
            if hi is None:
                # (past 2**50 ns a rounded term could be off by 1: no larger lambda is tried)
                if lam * 8 * (ph.magnitude() + abs(p.budget)) >= 2.0 ** 50:
                    break
                lam *= 8
                continue
            if lo is None:
                break  # the relaxed phase fits already at the smallest lambda tried: nothing to gain
            # The two supporting lines meet at the best lambda this bracket can hold; their
            # height there bounds every lambda's value from above.
            (l0, v0, s0), (l1, v1, s1) = lo, hi
            cross = (v1 - v0 + s0 * l0 - s1 * l1) / (s0 - s1)
            top = v0 + s0 * (cross - l0)
            if (cap is not None and top <= cap) or top - out.bound < 1 or not l0 < cross < l1:
                break
            lam = cross
    return out


def lower_bound(p: Problem, cap: int | None = None, at: list[int] | None = None, max_evals: int = 32) -> int | None:
    """:func:`relax`'s bound alone."""
    return relax(p, cap, at, max_evals).bound
