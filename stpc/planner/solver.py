"""solve: pick one choice per group minimising modelled step time under a memory budget.

The solver sees an abstract :class:`Problem` — integers only, no torch, no
torch.distributed — so it can be tested against brute force on random
instances (``tests/_oracles.py``).

Integer scaling: times are integer nanoseconds, memory integer bytes. Rounding
each term to 1 ns changes a step time of milliseconds by far less than the cost
model's own error; the optimum is exact for the rounded costs.

CP-SAT model
  x[g,c]  Boolean, exactly one per group (groups with one choice get no variable)
  e[k,p,q] Boolean per edge k and class pair (p, q), the transport linearisation:
          sum_q e[k,p,q] = sum_{c in class p} x[u,c]
          sum_p e[k,p,q] = sum_{c in class q} x[v,c]
          (exact for 0/1 values; its LP relaxation is tight on trees)
  T       integer >= transient of the chosen choice of every group (the max), plus what its
          incoming transient edges add at the chosen pairs (a resharded operand's copies)
  memory  sum mem[g,c] x[g,c] + T <= budget          (the end of forward)
          sum (mem + bwd_mem)[g,c] x[g,c] + sum bwd[k,p,q] f[k,p,q] + B <= budget
                                                     (the last layer's backward; f: the
                                                     transport variables of the memory edges;
                                                     B >= the chosen bwd_transient of every
                                                     group, the max)
          sum step_mem[g,c] x[g,c] + S <= budget     (the optimizer step; S >= the chosen
          step_transient of every group, the max)
          (in each phase that holds activations, + sum saved[k,p,q] s[k,p,q]: a saved tensor
          its one saver does not keep, negative)
          sum (mem + head_mem)[g,c] x[g,c] + sum head[k,p,q] h[k,p,q] <= budget
                                                     (the head's gradients reduced, before the
                                                     last layer's backward; h: the transport
                                                     variables of the head's memory edges)
  w[s,K]  integer per share s and key K: a reshard one producer's consumers share,
          paid once (``stpc.planner.sharing``)
  minimise sum cost[g,c] x[g,c] + sum cost[k,p,q] e[k,p,q] + sum w[s,K]
          (with a cap: only objective values <= cap, the objective's own domain)
Edges carry class maps so that the variables scale with the number of distinct
placements, not with the product of strategy counts.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from stpc.planner import sharing
from stpc.planner.elimination import TooWide, eliminate
from stpc.planner.sharing import Share


@dataclass
class Edge:
    u: int
    v: int
    ucls: tuple[int, ...]            # choice of u -> class
    vcls: tuple[int, ...]            # choice of v -> class
    table: dict[tuple[int, int], int]  # (class of u, class of v) -> ns (missing = 0)


@dataclass
class Problem:
    cost: list[list[int]]            # per group, per choice: ns
    mem: list[list[int]] = None      # per group, per choice: persistent bytes per device
    transient: list[list[int]] = None  # per group, per choice: working-set bytes
    edges: list[Edge] = field(default_factory=list)
    budget: int | None = None        # bytes per device
    cap: int | None = None           # only solutions with objective <= cap are wanted
    shares: list[Share] = field(default_factory=list)  # reshards paid once per distinct key
    # The second memory phase, the optimizer step (activations are gone, the parameter state
    # and the optimizer's scratch are alive): per group, per choice; None: no such phase.
    step_mem: list[list[int]] | None = None        # bytes alive throughout the step (summed)
    step_transient: list[list[int]] | None = None  # scratch alive one parameter at a time (max)
    # The third phase, the backward of the last layer: the saved activations and state of the
    # end of forward (``mem``), the largest ``bwd_transient`` (that layer's own working sets:
    # the loss's and the head's ended before it began; None: the largest ``transient``), plus,
    # per group and choice, ``bwd_mem`` (the gradients that layer computes) and, per pair of
    # choices, ``mem_edges`` (bytes, not ns: a parameter gathered again for backward, held by
    # the pair of its placement and its reader's); None / []: no such phase.
    bwd_mem: list[list[int]] | None = None
    mem_edges: list[Edge] = field(default_factory=list)
    bwd_transient: list[list[int]] | None = None
    # The fourth, the head's gradients being reduced (its backward done, the last layer's not
    # begun): the end of forward's ``mem``, plus per group and choice ``head_mem`` (what the
    # head's backward freed, negative, and the gradients it computed, at the placement they
    # were computed in) and per pair of choices ``head_edges`` (bytes: a gradient's reduction
    # buffers, held by the pair of a parameter's placement and its reader's); None / []: no
    # such phase.
    head_mem: list[list[int]] | None = None
    head_edges: list[Edge] = field(default_factory=list)
    # Per pair of choices, bytes held from the end of forward through backward (in every phase
    # but the optimizer step), beside ``mem``: negative where a saved tensor's only saver, under
    # its choice, keeps its own blocks instead (``Builder._saved_edges``).
    saved_edges: list[Edge] = field(default_factory=list)
    # Per pair of choices, bytes added to the consumer's (``e.v``'s) working set at the end of
    # forward: what an op holds only when its operand reaches it through a reshard (the
    # loss's second logits copy, ``Builder._transient_edges``). The phase's transient is the
    # largest of each group's own plus its incoming edges' at the chosen pairs.
    transient_edges: list[Edge] = field(default_factory=list)

    def __post_init__(self):
        n = [len(c) for c in self.cost]
        if self.mem is None:
            self.mem = [[0] * k for k in n]
        if self.transient is None:
            self.transient = [[0] * k for k in n]

    @property
    def backward_transient(self) -> list[list[int]]:
        """The working sets of the last layer's backward phase (``bwd_transient``, else the
        forward's)."""
        return self.transient if self.bwd_transient is None else self.bwd_transient

    def forward_transients(self, choice: list[int]) -> list[int]:
        """Per group, its working set at the end of forward under ``choice``: its own
        ``transient`` plus what its incoming ``transient_edges`` add at the chosen pairs."""
        out = [self.transient[g][c] for g, c in enumerate(choice)]
        for e in self.transient_edges:
            out[e.v] += e.table.get((e.ucls[choice[e.u]], e.vcls[choice[e.v]]), 0)
        return out

    @property
    def has_step_phase(self) -> bool:
        return self.step_mem is not None or self.step_transient is not None

    @property
    def has_bwd_phase(self) -> bool:
        return self.bwd_mem is not None or bool(self.mem_edges)

    @property
    def has_head_phase(self) -> bool:
        return self.head_mem is not None or bool(self.head_edges)

    def phase_peaks(self, choice: list[int]) -> tuple[int, int, int, int]:
        """(end-of-forward, head's gradient reduction, last layer's backward, optimizer-step)
        peak bytes of a full assignment (0 for a phase the problem does not have)."""
        held = sum(self.mem[g][c] for g, c in enumerate(choice))
        held += sum(e.table.get((e.ucls[choice[e.u]], e.vcls[choice[e.v]]), 0) for e in self.saved_edges)
        fwd = held + max(self.forward_transients(choice), default=0)
        head = 0
        if self.has_head_phase:
            head = held + (sum(self.head_mem[g][c] for g, c in enumerate(choice)) if self.head_mem is not None else 0)
            head += sum(e.table.get((e.ucls[choice[e.u]], e.vcls[choice[e.v]]), 0) for e in self.head_edges)
        bwd = 0
        if self.has_bwd_phase:
            bwd = held + max((self.backward_transient[g][c] for g, c in enumerate(choice)), default=0)
            bwd += sum(self.bwd_mem[g][c] for g, c in enumerate(choice)) if self.bwd_mem is not None else 0
            bwd += sum(e.table.get((e.ucls[choice[e.u]], e.vcls[choice[e.v]]), 0) for e in self.mem_edges)
        step = sum(self.step_mem[g][c] for g, c in enumerate(choice)) if self.step_mem is not None else 0
        if self.step_transient is not None:
            step += max((self.step_transient[g][c] for g, c in enumerate(choice)), default=0)
        return fwd, head, bwd, step

    def evaluate(self, choice: list[int]) -> tuple[int, int]:
        """(objective ns, peak bytes) of a full assignment: the peak of either phase."""
        obj = sum(self.cost[g][c] for g, c in enumerate(choice))
        for e in self.edges:
            obj += e.table.get((e.ucls[choice[e.u]], e.vcls[choice[e.v]]), 0)
        obj += sum(s.value(choice) for s in self.shares)
        return obj, max(self.phase_peaks(choice))

    def restricted(self, keep: list[list[int]], edges: list, shares: list | None = None) -> "Problem":
        """This problem with group g limited to the choices ``keep[g]`` (new edges given; the
        memory edges restricted alike)."""
        def sub(rows):
            return None if rows is None else [[r[c] for c in k] for r, k in zip(rows, keep)]
        def sub_edges(es):
            return [Edge(e.u, e.v, tuple(e.ucls[c] for c in keep[e.u]), tuple(e.vcls[c] for c in keep[e.v]), e.table)
                    for e in es]
        return Problem(cost=sub(self.cost), mem=sub(self.mem), transient=sub(self.transient), edges=edges,
                       budget=self.budget, cap=self.cap, shares=self.shares if shares is None else shares,
                       step_mem=sub(self.step_mem), step_transient=sub(self.step_transient),
                       bwd_mem=sub(self.bwd_mem), mem_edges=sub_edges(self.mem_edges),
                       bwd_transient=sub(self.bwd_transient), head_mem=sub(self.head_mem),
                       head_edges=sub_edges(self.head_edges), saved_edges=sub_edges(self.saved_edges),
                       transient_edges=sub_edges(self.transient_edges))


@dataclass
class Solution:
    choice: list[int]
    objective_ns: int
    peak_bytes: int
    status: str
    solve_time_s: float
    num_variables: int
    num_constraints: int
    method: str = "cpsat"


class NoBetterPlan(Exception):
    """No solution reaches the problem's objective cap (another mesh shape is better)."""


# CP-SAT's wall-clock limit on one solve, seconds (the search's on each budget-bound candidate)
TIME_LIMIT_S = 120.0


class SolverTimeout(RuntimeError):
    """CP-SAT found no solution within its time limit (status UNKNOWN): it proved neither
    that a solution under the problem's cap exists nor that none does."""

    def __init__(self, status: str, time_limit_s: float, where: str = ""):
        self.status, self.time_limit_s, self.where = status, time_limit_s, where
        super().__init__(f"CP-SAT returned {status} within {time_limit_s}s{where}")

    def __reduce__(self):  # (rank 0's search error is sent to the other ranks)
        return type(self), (self.status, self.time_limit_s, self.where)


class InfeasibleBudget(ValueError):
    """No assignment fits the memory budget; ``min_budget`` is the smallest that does.

    Where CP-SAT did not prove the least peak within its time limit, ``min_budget`` is the
    least peak of a plan it found (a budget that surely fits) and ``lower`` its proven bound
    (no smaller budget fits); proven, the two are equal."""

    def __init__(self, budget: int, min_budget: int, lower: int | None = None):
        self.budget, self.min_budget = budget, min_budget
        self.lower = min_budget if lower is None else lower
        if self.lower < min_budget:
            least = (f"the smallest feasible budget is between {self.lower / 2**30:.3f} and "
                     f"{min_budget / 2**30:.3f} GiB ({self.lower} to {min_budget} bytes; CP-SAT did not close "
                     "that gap within its time limit)")
        else:
            least = f"the smallest feasible budget is {min_budget / 2**30:.3f} GiB ({min_budget} bytes)"
        super().__init__(
            f"no plan fits the memory budget of {budget / 2**30:.3f} GiB per device; {least}. "
            "Raise --budget-gib, use more devices, or a smaller batch/sequence.")

    def __reduce__(self):  # (rank 0's search error is sent to the other ranks)
        return type(self), (self.budget, self.min_budget, self.lower)


def _build(p: Problem, minimise_memory: bool):
    m = cp_model.CpModel()
    x = []
    for g, costs in enumerate(p.cost):
        if len(costs) == 1:
            x.append(None)
            continue
        vs = [m.NewBoolVar(f"x{g}_{c}") for c in range(len(costs))]
        m.AddExactlyOne(vs)
        x.append(vs)

    def chosen(g, c):  # linear expression for "group g takes choice c"
        return x[g][c] if x[g] is not None else 1

    obj = []
    const = 0
    for g, costs in enumerate(p.cost):
        if x[g] is None:
            const += costs[0]
        else:
            obj += [costs[c] * x[g][c] for c in range(len(costs)) if costs[c]]
    n_edge_vars = 0
    for k, e in enumerate(p.edges):
        terms, c0, nv = _pair_terms(m, x, e, f"e{k}")
        obj += terms
        const += c0
        n_edge_vars += nv
    for k, share in enumerate(p.shares):
        obj += sharing.add_to_cpsat(m, x, share, str(k))
    if p.budget is None and not minimise_memory:  # memory does not constrain: skip its rows
        _minimise(m, sum(obj) + const, p.cap)
        return m, x, n_edge_vars
    held = _edge_sum(m, x, p.saved_edges, "s")  # (in every phase that holds the saved tensors)
    incoming = {}  # consumer group -> (the bytes its transient edges add at the chosen pairs, their most)
    for k, e in enumerate(p.transient_edges):
        t, c, _ = _pair_terms(m, x, e, f"t{k}")
        exprs, most = incoming.get(e.v, ([], 0))
        incoming[e.v] = (exprs + [sum(t) + c], most + max(0, max(e.table.values(), default=0)))
    phases = [_phase_memory(m, x, p.mem, p.transient, "transient", incoming=incoming) + held]
    if p.has_bwd_phase:
        phases.append(_phase_memory(m, x, p.mem, p.backward_transient, "bwd_transient", p.bwd_mem)
                      + _edge_sum(m, x, p.mem_edges, "f") + held)
    if p.has_step_phase:
        phases.append(_phase_memory(m, x, p.step_mem, p.step_transient, "step_transient"))
    if p.has_head_phase:
        phases.append(_phase_memory(m, x, p.mem, None, "head", p.head_mem) + _edge_sum(m, x, p.head_edges, "h") + held)
    if minimise_memory:
        top = sum(sum(max(0, max(r)) for r in rows) for rows in _memory_rows(p))  # (head_mem may be negative)
        top += sum(max(0, max(e.table.values(), default=0))
                   for e in (*p.mem_edges, *p.head_edges, *p.transient_edges, *p.saved_edges))
        peak = m.NewIntVar(0, top, "peak")
        for ph in phases:
            m.Add(peak >= ph)
        m.Minimize(peak)
    else:
        if p.budget is not None:
            for ph in phases:
                m.Add(ph <= p.budget)
        _minimise(m, sum(obj) + const, p.cap)
    return m, x, n_edge_vars


def _minimise(m, objective, cap: int | None) -> None:
    """Minimise ``objective``; with ``cap``, only values up to it are wanted. The cap is the
    objective's own domain (``CpObjectiveProto.domain``, which CP-SAT's objective propagation
    reads directly), not a linear row repeating every objective term beside it. Measured on
    the capped problems of two primepar cells (opt-175b at 5 layers on 8 V100s, mesh 2x2x2;
    llama2-7b at 23 layers on 4, seven of its nine capped candidates), one worker, row
    against domain: 127 s against 48 s, 17 / 12, 70 / 71, out of time at 130 / 79, 69 / 89,
    and under a second either way on the other three; whole searches: opt-175b on 8, 133.6 s with 2x2x2
    unresolved -> 58.5 s proven; llama2-7b on 4, 282 s with one unresolved -> 258 s proven."""
    m.Minimize(objective)
    if cap is None:
        return
    proto = m.Proto().objective
    # the domain bounds the terms' sum before the offset (the constant part) is added
    assert proto.scaling_factor in (0, 1), proto.scaling_factor
    offset = round(proto.offset)
    proto.domain.clear()
    proto.domain.extend([-(2 ** 62), cap - offset])


def _edge_sum(m, x, edges: list[Edge], prefix: str):
    """CP-SAT expression of the bytes (or ns) ``edges`` charge at the chosen pairs."""
    terms, const = [], 0
    for k, e in enumerate(edges):
        t, c, _ = _pair_terms(m, x, e, f"{prefix}{k}")
        terms += t
        const += c
    return sum(terms) + const


def _pair_terms(m, x, e: Edge, name: str):
    """(linear terms, constant, new variables) of ``e.table`` at the chosen classes of its two
    groups. Transport (local-polytope) linearisation: one Boolean per class pair, whose row
    sums are the producer's class indicators and column sums the consumer's. Its LP
    relaxation is tight on trees, which keeps CP-SAT's bound strong."""
    if not any(e.table.values()):
        return [], 0, 0
    ucls, vcls = e.ucls, e.vcls
    if x[e.u] is None and x[e.v] is None:
        return [], e.table.get((ucls[0], vcls[0]), 0), 0
    if e.u == e.v:  # a self-edge (tied layers): both ends take the same choice
        return [e.table.get((ucls[c], vcls[c]), 0) * x[e.u][c] for c in range(len(ucls))
                if e.table.get((ucls[c], vcls[c]), 0)], 0, 0
    if x[e.u] is None:
        return [e.table.get((ucls[0], vcls[c]), 0) * x[e.v][c] for c in range(len(vcls))
                if e.table.get((ucls[0], vcls[c]), 0)], 0, 0
    if x[e.v] is None:
        return [e.table.get((ucls[c], vcls[0]), 0) * x[e.u][c] for c in range(len(ucls))
                if e.table.get((ucls[c], vcls[0]), 0)], 0, 0
    P, Q = sorted(set(ucls)), sorted(set(vcls))
    ev = {(pc, qc): m.NewBoolVar(f"{name}_{pc}_{qc}") for pc in P for qc in Q}
    for pc in P:
        m.Add(sum(ev[pc, qc] for qc in Q) == sum(x[e.u][c] for c in range(len(ucls)) if ucls[c] == pc))
    for qc in Q:
        m.Add(sum(ev[pc, qc] for pc in P) == sum(x[e.v][c] for c in range(len(vcls)) if vcls[c] == qc))
    return [w * ev[pq] for pq, w in sorted(e.table.items()) if w and pq in ev], 0, len(ev)


def _memory_rows(p: Problem) -> list:
    return [r for r in (p.mem, p.transient, p.bwd_mem, p.bwd_transient, p.step_mem, p.step_transient, p.head_mem)
            if r is not None]


def _phase_memory(m, x, summed, maxed, name: str, also=None, incoming=None):
    """CP-SAT expression of one memory phase's bytes: the chosen ``summed`` (and ``also``)
    bytes of every group plus the largest chosen ``maxed`` bytes (an integer variable
    ``name`` at least each group's, with the expressions ``incoming[g]`` added to group g's);
    any list may be None (nothing of that kind in the phase).

    Tried and measured worse (the thirty-eighth session, commit fcfb409, reverted): the max in
    threshold form (a Boolean "the max reaches v" per working-set size v above the groups'
    largest least, each group's choices of v or more summed at most it), whose LP relaxation
    is tighter. On opt-175b at 10 layers on 16 V100s it helped (unresolved candidates 3 -> 1,
    search 407 s -> 302 s), but over the 14 primepar jobs it finished it lost proofs that the
    plain form makes (llama2-7b on 4 V100s, opt-175b on 16 H100s), left llama2-70b on 32 V100s
    with 4 unresolved candidates instead of 3, and searched 5556 s against 5058 s: with one
    worker, CP-SAT branches on the threshold Booleans too."""
    terms, const = [], 0
    for rows in (summed, also):
        for g, mems in enumerate(rows or []):
            if x[g] is None:
                const += mems[0]
            else:
                terms += [mems[c] * x[g][c] for c in range(len(mems)) if mems[c]]
    if maxed is not None:
        incoming = incoming or {}
        hi = max((max(t) for t in maxed), default=0) + max((most for _, most in incoming.values()), default=0)
        top = m.NewIntVar(0, max(0, hi), name)
        for g, ts in enumerate(maxed):
            own = ts[0] if x[g] is None else sum(ts[c] * x[g][c] for c in range(len(ts)) if ts[c])
            if g in incoming:
                m.Add(top >= own + sum(incoming[g][0]))
            elif x[g] is None or any(ts):
                m.Add(top >= own)
        terms.append(top)
    return sum(terms) + const


def prune_dominated(p: Problem, rounds: int = 2) -> tuple[Problem, list[list[int]]]:
    """Drop choices another choice of the same group dominates: no more costly,
    memory-hungry or transient-heavy, and no worse on every incident edge whatever
    the neighbour picks. Any solution using a dominated choice stays as good (and
    as feasible) with its dominator, so the optimum is unchanged: exact.
    Returns the reduced problem and, per group, the kept original choice indices."""

    keep = [list(range(len(c))) for c in p.cost]
    in_share = {g for s in p.shares for g in (s.u, *s.vs)}  # (their costs are not pairwise: kept whole)
    for _ in range(rounds):
        incident = [[] for _ in p.cost]
        for e in (*p.edges, *p.mem_edges, *p.head_edges, *p.saved_edges, *p.transient_edges):  # (time and memory)
            incident[e.u].append(e)
            if e.v != e.u:
                incident[e.v].append(e)
        changed = False
        for g in range(len(p.cost)):
            k = keep[g]
            if len(k) < 2 or g in in_share:
                continue
            cols = [[row[g][c] for c in k] for row in (p.cost, *_memory_rows(p))]
            self_edge = False
            for e in incident[g]:
                if e.u == e.v:
                    self_edge = True
                    break
                if e.u == g:
                    others = sorted({e.vcls[c] for c in keep[e.v]})
                    for q in others:
                        cols.append([e.table.get((e.ucls[c], q), 0) for c in k])
                else:
                    others = sorted({e.ucls[c] for c in keep[e.u]})
                    for pc in others:
                        cols.append([e.table.get((pc, e.vcls[c]), 0) for c in k])
            if self_edge:
                continue
            v = np.array(cols, dtype=np.int64).T  # choices x features
            le = (v[:, None, :] <= v[None, :, :]).all(-1)   # le[a, b]: a no worse than b
            dominated = set()
            for b in range(len(k)):
                for a in range(len(k)):
                    # strictly dominated, or equal and a comes first (keep one of equals)
                    if a != b and a not in dominated and le[a, b] and (not le[b, a] or a < b):
                        dominated.add(b)
                        break
            if dominated:
                keep[g] = [c for i, c in enumerate(k) if i not in dominated]
                changed = True
        if not changed:
            break
    q = p.restricted(keep, [Edge(e.u, e.v, tuple(e.ucls[c] for c in keep[e.u]),
                                 tuple(e.vcls[c] for c in keep[e.v]), e.table) for e in p.edges])
    return q, keep


def _solver(time_limit_s: float) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1      # one worker: bit-identical results in every process
    solver.parameters.random_seed = 0
    # Probing in presolve costs more than it saves on these models (measured on the
    # zoo: 2-3x faster without it); the search is still complete.
    solver.parameters.cp_model_probing_level = 0
    # Tried and reverted (the thirty-ninth session): CP-SAT's LP relaxation at
    # linearization level 2. On the four candidates of opt-175b at 10 layers on 16 V100s
    # (fp16; one worker, 120 s each) it proved the three capped ones infeasible in 82, 44 and
    # 16 s, where level 1 ran out of time on two; the uncapped one stayed unproven either way,
    # so the cell's plan did too. The planner bench (`python -m stpc bench planner`) measured
    # bloom-7b1 on 8 V100s at 12.7 s of search against 7.7 s, the other cells from 8% faster
    # to 11% slower.
    solver.parameters.max_time_in_seconds = time_limit_s
    return solver


class _Progress(cp_model.CpSolverSolutionCallback):
    """CP-SAT's better solutions and bounds, passed on as ``fn(objective_ns, bound_ns)``
    (either may be None). An exception ``fn`` raises stops the search; ``solve`` re-raises it."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.error = fn, None

    def _call(self, objective, bound):
        if self.error is not None:
            return
        try:
            self.fn(objective, bound)
        except BaseException as e:  # (raised in the solver's thread: carried back to the caller)
            self.error = e
            self.StopSearch()

    def on_solution_callback(self):
        self._call(round(self.ObjectiveValue()), math.ceil(self.BestObjectiveBound()))

    def on_bound(self, bound: float):
        self._call(None, math.ceil(bound))


def solve(p: Problem, time_limit_s: float = TIME_LIMIT_S, prune: bool = True, method: str = "auto",
          on_progress=None, hint: list[int] | None = None) -> Solution:
    """Exact optimum; deterministic.

    ``auto``: an infeasible budget is detected exactly by :func:`min_memory`; then
    the objective alone is minimised by variable elimination (``stpc.planner.elimination``),
    ties going to the least memory. That optimum is a lower bound of the budgeted
    problem, so if it fits the budget it is the answer. Only when the budget binds
    (or the graph is too wide to eliminate) does CP-SAT solve the full model.
    ``cpsat``: CP-SAT only (one worker, fixed seed), dominated choices pruned first
    (exact, see :func:`prune_dominated`). ``on_progress(objective_ns, bound_ns)``, if
    given, is called at each better solution and each raised bound CP-SAT finds (either
    argument may be None); an exception it raises stops the solve and propagates.
    ``hint``: a choice per group CP-SAT starts its search from (``CpModel.AddHint``; the
    search's memory-blind optimum: it need not fit the budget or the cap). It changes how
    fast CP-SAT gets there, not the answer: on the five slowest capped problems measured
    (``_minimise``'s), 48 / 12 / 71 / 79 / 89 s without it, 36 / 2 / 103 / 56 / 44 s with it."""
    t0 = time.perf_counter()
    if method == "auto":
        if p.budget is not None and min_memory_bound(p) > p.budget:
            raise _infeasible(p)
        choice, obj, peak = memory_blind_optimum(p)
        if choice is not None:
            if p.cap is not None and obj > p.cap:  # a lower bound of the budgeted optimum too
                raise NoBetterPlan()
            if p.budget is None or peak <= p.budget:
                return eliminated(p, choice, obj, peak, time.perf_counter() - t0)
    if p.budget is not None:
        # The budget binds. Before the full model, the memory-only one (small, no time
        # terms): where no assignment fits at all it says so far sooner than the full model
        # proves it (the cheap bound leaves out the pairwise memory terms, such as the loss's
        # copy behind a reshard, which can be what makes a point not fit: bloom-7b1 on 8
        # V100s, three infeasible points at 3.7 s each in the full model, 0.3 s here). A
        # yes-or-no question (``fits_memory``), not the least peak, which only a point that
        # does not fit needs, for its error.
        if not fits_memory(p, time_limit_s):
            raise _infeasible(p)
    full = p
    if prune:
        p, keep = prune_dominated(p)
    m, x, n_edge_vars = _build(p, minimise_memory=False)
    if hint is not None:
        _add_hint(m, x, hint, keep if prune else None)
    solver = _solver(time_limit_s)
    if on_progress is None:
        status = solver.Solve(m)
    else:
        reporter = _Progress(on_progress)
        solver.best_bound_callback = reporter.on_bound
        status = solver.Solve(m, reporter)
        if reporter.error is not None:
            raise reporter.error
    if status == cp_model.INFEASIBLE:
        if p.cap is not None:
            raise NoBetterPlan()
        raise _infeasible(full)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverTimeout(solver.StatusName(status), time_limit_s)
    choice = [0 if xs is None else next(c for c, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x]
    if prune:
        choice = [keep[g][c] for g, c in enumerate(choice)]
    obj, peak = full.evaluate(choice)
    proto = m.Proto()
    return Solution(choice=choice, objective_ns=obj, peak_bytes=peak, status=solver.StatusName(status),
                    solve_time_s=time.perf_counter() - t0, num_variables=len(proto.variables),
                    num_constraints=len(proto.constraints))


def _add_hint(m, x, hint: list[int], keep: list[list[int]] | None) -> None:
    """Hint group g's Booleans to ``hint[g]`` (an index into the unpruned choices; ``keep``
    maps them to the pruned model's). A group whose hinted choice was pruned as dominated
    gets no hint: CP-SAT completes a partial one."""
    for g, xs in enumerate(x):
        if xs is None:
            continue
        c = hint[g] if keep is None else (keep[g].index(hint[g]) if hint[g] in keep[g] else None)
        if c is not None:
            for j, v in enumerate(xs):
                m.AddHint(v, j == c)


def memory_blind_optimum(p: Problem) -> tuple[list[int] | None, int, int | None]:
    """(choice, objective ns, peak bytes) of :func:`solve_unconstrained`'s optimum: a
    lower bound of the budgeted optimum. ``(None, 0, None)`` when the graph is too
    wide to eliminate (the bound is then 0)."""
    try:
        choice = solve_unconstrained(p)
    except TooWide:
        return None, 0, None
    return (choice, *p.evaluate(choice))


def eliminated(p: Problem, choice: list[int], objective_ns: int, peak_bytes: int, seconds: float) -> Solution:
    """The Solution of an elimination optimum that fits the budget (it is optimal)."""
    return Solution(choice=choice, objective_ns=objective_ns, peak_bytes=peak_bytes, status="OPTIMAL",
                    solve_time_s=seconds, num_variables=sum(len(c) for c in p.cost if len(c) > 1),
                    num_constraints=0, method="elimination")


def min_memory(p: Problem, time_limit_s: float = 60.0) -> int:
    """The smallest per-device peak any assignment reaches, exactly.

    With the end of forward alone, memory has no pairwise terms: for a transient cap ``t``
    every group takes its least-memory choice among those with transient <= ``t``; the
    answer is the best ``t`` among the transients that occur. With the last layer's
    backward or the optimizer step too, the peak is the largest of several sums, and
    CP-SAT minimises it (a model of the groups and the memory edges alone, no time: small).
    Raises :class:`SolverTimeout` where CP-SAT does not prove it within ``time_limit_s``
    (:func:`least_memory` gives the bounds it reached)."""
    lower, upper = least_memory(p, time_limit_s)
    if lower < upper:
        raise SolverTimeout("FEASIBLE", time_limit_s, f" on the least peak (between {lower} and {upper} bytes)")
    return upper


def least_memory(p: Problem, time_limit_s: float = 60.0) -> tuple[int, int]:
    """``(lower, upper)``: bounds of :func:`min_memory`, equal where it is proven; else the
    least peak of a plan CP-SAT found within ``time_limit_s`` and its proven bound. Raises
    :class:`SolverTimeout` where it found no plan at all."""
    if p.has_step_phase or p.has_bwd_phase or p.has_head_phase or p.saved_edges or p.transient_edges:
        return _min_peak_phases(p, time_limit_s)
    least = _min_forward_peak(p)
    return least, least


def _infeasible(p: Problem) -> InfeasibleBudget:
    """The error of ``p``, whose budget no assignment fits: its least peak, and where CP-SAT
    did not prove that, a lower bound raised to what is known besides (over the budget, and
    at least the cheap per-phase bound)."""
    lower, upper = least_memory(p)
    lower = max(lower, min_memory_bound(p), math.floor(p.budget) + 1)
    return InfeasibleBudget(p.budget, upper, min(lower, upper))


def fits_memory(p: Problem, time_limit_s: float = 60.0) -> bool:
    """Whether some assignment's per-device peak fits ``p.budget`` (the memory rows and
    edges alone): CP-SAT asked for any assignment under the budget, not for the least peak.
    Far quicker to settle where many assignments lie near the least peak (llama2-70b at 46
    layers on 32 V100s: its least-memory model ran out of 60 s with plans under the budget
    in hand). Raises :class:`SolverTimeout` where it settles neither way in time."""
    if min_memory_bound(p) > p.budget:
        return False
    m, _, _ = _build(_memory_only(p), minimise_memory=False)   # the budget's rows, no objective
    solver = _solver(time_limit_s)
    status = solver.Solve(m)
    if status == cp_model.INFEASIBLE:
        return False
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return True
    raise SolverTimeout(solver.StatusName(status), time_limit_s, " on whether any plan fits the memory budget")


def min_memory_bound(p: Problem) -> int:
    """A lower bound of :func:`min_memory`, cheap: each phase's own minimum (the memory
    edges that are never negative left out; the saved tensors' edges at their least)."""
    # (a pair absent from a table holds 0)
    saved = sum(min(0, min(e.table.values(), default=0)) for e in p.saved_edges)
    fwd = _min_forward_peak(p) + saved
    bounds = [fwd]
    if p.bwd_mem is not None:
        tr = max(min(t) for t in p.backward_transient) if p.backward_transient else 0
        bounds.append(sum(min(a + b for a, b in zip(r, e)) for r, e in zip(p.mem, p.bwd_mem)) + tr + saved)
    if p.has_step_phase:
        step = sum(min(r) for r in p.step_mem) if p.step_mem is not None else 0
        if p.step_transient is not None:
            step += max(min(t) for t in p.step_transient)
        bounds.append(step)
    if p.head_mem is not None:
        bounds.append(sum(min(a + b for a, b in zip(r, e)) for r, e in zip(p.mem, p.head_mem)) + saved)
    return max(bounds)


def _min_peak_phases(p: Problem, time_limit_s: float) -> tuple[int, int]:
    lower, upper = 0, None
    if p.transient_edges and all(v >= 0 for e in p.transient_edges for v in e.table.values()):
        # Without its transient edges (never negative) the least peak is a lower bound, and a
        # quicker model (CP-SAT takes several times longer with the loss's pairwise copy): where
        # its least-memory choice peaks no higher with the edges, that is the answer exactly
        choice, lower = _least_memory_choice(dataclasses.replace(p, transient_edges=[]), time_limit_s)
        upper = max(p.phase_peaks(choice))
        if upper == lower:
            return lower, upper
    try:
        choice, bound = _least_memory_choice(p, time_limit_s)
    except SolverTimeout:
        if upper is None:
            raise
        return lower, upper   # (the relaxation's plan and bound stand)
    peak = max(p.phase_peaks(choice))
    return max(lower, bound), peak if upper is None else min(upper, peak)


def _memory_only(p: Problem) -> Problem:
    """``p`` without its time: the memory rows and edges, every cost 0."""
    return Problem(cost=[[0] * len(c) for c in p.cost], mem=p.mem, transient=p.transient,
                   step_mem=p.step_mem, step_transient=p.step_transient, bwd_mem=p.bwd_mem, mem_edges=p.mem_edges,
                   bwd_transient=p.bwd_transient, head_mem=p.head_mem, head_edges=p.head_edges,
                   saved_edges=p.saved_edges, transient_edges=p.transient_edges, budget=p.budget)


def _least_memory_choice(p: Problem, time_limit_s: float) -> tuple[list[int], int]:
    """(an assignment of least peak found, CP-SAT's proven lower bound of the least peak:
    the assignment's own peak where it proved it optimal): the memory rows and edges alone,
    CP-SAT minimising the largest phase."""
    m, x, _ = _build(dataclasses.replace(_memory_only(p), budget=None), minimise_memory=True)
    solver = _solver(time_limit_s)
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverTimeout(solver.StatusName(status), time_limit_s, " on the least peak (no plan found)")
    choice = [0 if xs is None else next(c for c, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x]
    bound = round(solver.ObjectiveValue()) if status == cp_model.OPTIMAL else math.ceil(solver.BestObjectiveBound())
    return choice, bound


def _min_forward_peak(p: Problem) -> int:
    ts = np.unique(np.concatenate([np.asarray(t, dtype=np.int64) for t in p.transient]))
    ts = ts[ts >= max(min(t) for t in p.transient)]  # below this some group has no choice
    total = ts.copy()
    for mem, tr in zip(p.mem, p.transient):
        order = np.argsort(np.asarray(tr, dtype=np.int64), kind="stable")
        tr_sorted = np.asarray(tr, dtype=np.int64)[order]
        best_mem = np.minimum.accumulate(np.asarray(mem, dtype=np.int64)[order])
        total += best_mem[np.searchsorted(tr_sorted, ts, side="right") - 1]
    return int(total.min())


def solve_unconstrained(p: Problem) -> list[int]:
    """The exact minimum of the objective alone (no memory rows) by variable elimination;
    among equal-cost optima, one of least persistent memory (quantised to fit a
    lexicographic int64 key). Raises ``elimination.TooWide`` on too wide a graph."""
    n = len(p.cost)
    pairs: dict[tuple[int, int], list] = {}  # class tables per pair of groups (elimination's form)
    unary = [np.asarray(c, dtype=np.int64) for c in p.cost]
    # Lexicographic key cost * scale + quantised memory, with the memory sum < scale,
    # when every sum stays in int64 (ub bounds the objective of any assignment).
    ub = (sum(int(u.max()) for u in unary) + sum(max(0, *e.table.values()) for e in p.edges if e.table)
          + sum(int(s.cost.max(initial=0)) * len(s.vs) for s in p.shares))
    scale = 1 << 20 if (ub + 1) * (1 << 20) < (1 << 58) else 1
    if scale > 1:
        unit = -(-(sum(max(m) for m in p.mem) + 1) // (scale - 1))
        unary = [u * scale + np.asarray(m, dtype=np.int64) // unit for u, m in zip(unary, p.mem)]
    for e in p.edges:
        if not e.table:
            continue
        ucls = np.fromiter(e.ucls, dtype=np.intp, count=len(e.ucls))
        vcls = np.fromiter(e.vcls, dtype=np.intp, count=len(e.vcls))
        t = np.zeros((max(int(ucls.max()), *(a for a, _ in e.table)) + 1,
                      max(int(vcls.max()), *(b for _, b in e.table)) + 1), dtype=np.int64)
        for (a, b), c in e.table.items():  # (a few dozen class pairs)
            t[a, b] = c * scale
        if e.u == e.v:  # both ends take the same choice
            unary[e.u] = unary[e.u] + t[ucls, vcls]
        elif e.u < e.v:
            pairs.setdefault((e.u, e.v), []).append((ucls, vcls, t))
        else:
            pairs.setdefault((e.v, e.u), []).append((vcls, ucls, t.T))
    back = sharing.reduce(unary, pairs, p.shares, scale)
    _, choice = eliminate(unary, pairs)
    back(choice)
    assert len(choice) == n
    return choice
