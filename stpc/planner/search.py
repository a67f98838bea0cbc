"""search: plan on every logical mesh shape of N devices and keep the best.

A shape views the N devices as up to three axes (row-major, the last axis
innermost). Every factorisation of N into at most three factors >= 2 is tried,
each ordered largest-first so the smallest axes are innermost and stay inside
a node (a permutation of the same factors only moves which groups cross node
boundaries; pass an explicit shape such as ``4x8`` to choose it yourself).
Each shape is solved exactly; the lowest modelled step time wins (ties: the
fewer axes, then the earlier shape). Times within ``TIE_TOLERANCE`` of each other are a
tie on speed, which the lower modelled peak memory breaks: the model cannot tell them
apart (its error against measured runs is percents), and the smaller plan leaves the
budget more room.

The baseline presets (``stpc.planner.baselines``: ``megatron``, ``fsdp-tp``,
``spatial``) are searched the same way over their own spaces: the candidates are
then their layouts (every DP x TP factorisation, both axis orders, ZeRO on or
off), each a mesh shape with its hints; ``plan.stats["layout"]`` records the one
chosen.

Activation recomputation (``Hints.recompute``) makes every assignment slower, so a point
whose memory-blind optimum fits the budget never gains from it: only a point where the
budget binds (or that no assignment fits) is built again with its layers recomputed,
selectively (their matmuls' and fused attentions' outputs kept) and in full: each a
candidate of its own (``"recompute": "selective"`` or ``"full"`` in its layout record). At
each level the first k layers are recomputed (``Hints.recompute_layers``), k on a ladder
of fractions of the layers (``RECOMPUTE_FRACTIONS``, ``recompute_counts``): each k a
candidate (``"recompute_layers"`` in its layout record, none where k is every layer).
These rungs are built lazily: their groups only, bounded by each group's least cost summed
(edges and shares charge no negative time); the second phase builds a rung's edges only if
it reaches that bound unpruned (``"edges_built": False`` in the entry of one it pruned
before).

Two phases. First every candidate's problem is built (a rung of the ladder: its groups), a
cheap lower bound of its smallest feasible memory checked against the budget (one over it
is out; its exact least memory, a CP-SAT solve, is found only if no candidate gives a
plan, for the error's smallest feasible budget), and its objective minimised without the
memory rows (variable elimination: milliseconds). That optimum is a lower bound of the
candidate's budgeted optimum. Then candidates are visited cheapest bound first, those
that need CP-SAT after all that do not (the cheap ones leave an incumbent that prunes or
caps them): one whose memory-blind optimum fits the budget is solved; one where the
budget binds goes to CP-SAT,
capped by the best plan so far, unless its Lagrangian bound (its memory rows priced into
the objective, ``stpc.planner.lagrangian``: eliminations, no CP-SAT) already proves it
cannot beat that plan. The same relaxation's minimisers that fit the budget are plans in
hand: the best of them caps CP-SAT further (it has only to beat it, or prove nothing does)
and stands for its candidate where CP-SAT runs out of time (not proven optimal), so a
loaded machine still gets a plan. A candidate whose bound cannot beat the best plan is
discarded unsolved.

``progress=`` takes a callable that receives a :class:`SearchProgress` as each candidate
is taken up in either phase (and, while CP-SAT runs, at each better solution or bound it
finds), then once when the search is done: what is being worked on, the best modelled
step time so far (the incumbent) and a lower bound on the optimum, with the elapsed
time. It is a plain callback (``python -m stpc`` draws a progress line from it); an
exception it raises stops the search and propagates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import math
import time
from typing import Callable

from stpc.cost_models import GRAD_BUCKET_BYTES, CostModel, MemoryModel, get_cluster
from stpc.frontend.trace import TracedGraph
from stpc.planner import baselines, lagrangian
from stpc.planner.analysis import analyse
from stpc.planner.builder import NS, Builder, build_problem, make_plan
from stpc.planner.hints import RECOMPUTE_LEVELS, HintUnsatisfiable, Hints, preset
from stpc.planner.plan import Plan
from stpc.planner.report import indivisible
from stpc.planner.solver import (TIME_LIMIT_S, InfeasibleBudget, NoBetterPlan, Problem, Solution, SolverTimeout,
                                 eliminated, fits_memory, least_memory, memory_blind_optimum, min_memory_bound,
                                 solve)


def mesh_shapes(n: int, max_axes: int = 3, cluster=None) -> list[tuple[int, ...]]:
    """Every factorisation of ``n`` into at most ``max_axes`` factors >= 2, in every order
    (the order decides which axis is innermost, i.e. which groups share a node: 2x8 and 8x2
    are different layouts, and a baseline may use either), fewest axes first, then largest
    factors first. With ``cluster``: an order whose axes cost exactly as an earlier
    shape's (the same (size, link) per axis, permuted) is the same problem with its axes
    renamed, and is left out."""
    out = []

    def rec(rest, prefix):
        if rest == 1:
            if prefix:
                out.append(tuple(prefix))
            return
        if len(prefix) == max_axes:
            return
        for f in range(rest, 1, -1):
            if rest % f == 0:
                rec(rest // f, prefix + [f])

    rec(n, [])
    out = sorted(out, key=lambda s: (len(s), [-f for f in s])) or [(1,)]
    if cluster is None:
        return out
    kept, seen = [], set()
    for s in out:
        cm = CostModel(cluster, s) if math.prod(s) <= cluster.num_devices else None
        key = tuple(sorted(map(str, (cm.axis_signature(a) for a in range(len(s)))))) if cm else s
        if key not in seen:
            seen.add(key)
            kept.append(s)
    return kept


def parse_mesh(spec) -> tuple[tuple[int, ...] | None, int]:
    """``"32"`` -> (None, 32): the planner chooses the shape; ``"4x8"`` -> ((4, 8), 32)."""
    if isinstance(spec, int):
        return None, spec
    if isinstance(spec, (tuple, list)):
        shape = tuple(int(x) for x in spec)
        return shape, math.prod(shape)
    parts = [int(x) for x in str(spec).lower().split("x")]
    return (None, parts[0]) if len(parts) == 1 else (tuple(parts), math.prod(parts))


# The fractions of the layers the search recomputes (the first k layers: ``Hints.recompute_layers``)
# where the budget binds: a ladder, not every k, so that a point costs at most four builds per
# level (a model of L layers could take L); a budget between two rungs pays the upper one's time.
RECOMPUTE_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def recompute_counts(n_layers: int) -> list[int | None]:
    """The rungs of the recomputation ladder for a model of ``n_layers`` layers, fewest
    first: distinct counts of leading layers, None (every layer) last."""
    counts = sorted({max(1, math.ceil(f * n_layers)) for f in RECOMPUTE_FRACTIONS} - {n_layers})
    return [k for k in counts if k < n_layers] + [None]


def _candidates(hints, shape, n, cluster=None) -> list[tuple[tuple[int, ...], Hints, dict]]:
    """(mesh shape, hints, what it is) of every point the search solves: the layouts of a
    baseline preset, else every mesh shape (or the one given) under the hints."""
    shapes = [shape] if shape else mesh_shapes(n, cluster=cluster)
    if hints in baselines.BASELINES:
        return baselines.candidates(hints, n, shape, shapes)
    if hints is None:  # stpc's own space: both ways of running a sharded weight (baselines.own_points)
        return baselines.own_points(shapes, Hints())
    return [(s, preset(hints, s) if isinstance(hints, str) else hints,
             {"mesh": "x".join(map(str, s))}) for s in shapes]


@contextlib.contextmanager
def _no_gc():
    """The search allocates many small short-lived objects next to a traced graph of
    many long-lived ones: a cyclic-GC pass over that heap costs more than a whole
    1-D shape (measured: 0.40 -> 0.22 s for llama2-7b on 8 devices). It creates no
    cycles worth collecting, so collection waits until it returns."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class SearchProgress:
    """One report of :func:`search` to its ``progress`` callback.

    ``phase``: ``"build"`` (a candidate's problem is being built and its memory-blind
    optimum found by variable elimination), ``"solve"`` (a candidate is being solved, or
    pruned by its bound), ``"cpsat"`` (CP-SAT, solving a candidate the budget binds on,
    found a better solution or raised its bound), ``"done"`` (the search returns).
    ``candidate``: the mesh shape (``"mesh 4x2"``) or baseline layout being worked on.
    ``done`` / ``total``: candidates finished in this phase / in all. ``incumbent_s``: the
    best modelled step time found so far (None before the first plan). ``bound_s``: a
    lower bound on the step time the search will return: the least of the incumbent, the
    memory-blind optima of the candidates still unsolved (a budget can only raise a
    candidate's optimum above it) and CP-SAT's own bound on the one it is solving (None
    while candidates are still being built, or while one too wide to eliminate has no
    bound yet); at ``"done"`` it equals the incumbent. ``elapsed_s``: seconds since the
    search began."""

    phase: str
    candidate: str
    done: int
    total: int
    incumbent_s: float | None
    bound_s: float | None
    elapsed_s: float


def search(tg: TracedGraph, mesh, cluster="cpu-local", budget_bytes: float | None = None,
           hints: str | Hints | None = None, temporal: bool = True, dtype: str = "fp32",
           optimizer_layout: str = "fp32-adam",
           progress: Callable[[SearchProgress], None] | None = None, recompute: str | None = None,
           time_limit_s: float = TIME_LIMIT_S, recompute_layers: int | None = None,
           optimizer_impl: str = "foreach", grad_bucket_bytes: float | None = GRAD_BUCKET_BYTES) -> Plan:
    """Plan ``tg`` on ``mesh`` (an int N, "N", "AxB", or a shape tuple). ``hints``: a
    ``Hints``, or a preset name: ``megatron``, ``fsdp-tp`` and ``spatial`` search their
    whole layout space (``stpc.planner.baselines``; a given shape keeps the layouts on it),
    ``dp`` constrains each mesh shape. None (stpc's own space) tries each shape with sharded
    weights regathered in backward and kept from forward (``baselines.own_points``); a
    ``Hints`` given is one point per shape, its own ``keep_gathered`` as it says. ``progress``: called with a :class:`SearchProgress`
    as the search goes (module docstring). ``recompute``: ``"full"``, ``"selective"`` or ``"none"`` sets
    ``Hints.recompute`` on every point (a preset's too); None leaves each point's own (the
    presets' and stpc's own: recompute where the budget binds); ``recompute_layers`` with it:
    only that many leading layers (``Hints.recompute_layers``). ``time_limit_s``: CP-SAT's
    wall-clock limit on each candidate the budget binds on (one that runs out without a
    solution is left unresolved: ``plan.stats["unresolved"]``). ``optimizer_impl``: the AdamW
    implementation the trainer steps with (``"foreach"``, ``"fused"``: ``AdamW(fused=True)``,
    TorchTitan's default; ``"single"``: the per-tensor loop), whose step time and scratch
    every plan is charged (``cost_models.MemoryModel.step_scratch``,
    ``cost_models.optimizer_step_time``). ``grad_bucket_bytes``: the runtime's data-parallel
    gradient buckets (``stpc.compile``'s ``bucket_mb``), None for none (each gradient summed
    where it is made, waited there: ``MemoryModel.grad_bucket_bytes``)."""
    if recompute not in RECOMPUTE_LEVELS:
        raise ValueError(f"recompute={recompute!r}: one of {', '.join(map(repr, RECOMPUTE_LEVELS))}")
    if recompute_layers is not None:  # (the same check as Hints')
        Hints(recompute=recompute, recompute_layers=recompute_layers)
    # (an unknown optimizer, or a bucket size that is no number of bytes, fails here)
    memory = MemoryModel(optimizer_layout, optimizer_impl=optimizer_impl, grad_bucket_bytes=grad_bucket_bytes)
    with _no_gc():
        return _search(tg, mesh, cluster, budget_bytes, hints, temporal, dtype, memory, progress, recompute,
                       time_limit_s, recompute_layers)


@dataclasses.dataclass
class _Shape:
    """One mesh shape after the first phase: its problem and memory-blind optimum."""

    index: int
    mesh: tuple
    layout: dict             # what the candidate is (a baseline's layout; else its mesh)
    builder: Builder
    problem: Problem
    choice: list | None      # elimination's optimum (None: too wide to eliminate)
    bound: int               # its objective, ns: a lower bound under the budget
    peak: int | None
    build_s: float
    bound_s: float
    lazy: bool = False       # edges not built yet: ``bound`` is each group's least cost summed

    def fits(self) -> bool:
        return self.choice is not None and (self.problem.budget is None or self.peak <= self.problem.budget)


def _name(layout: dict) -> str:
    """A candidate as a progress report names it: ``mesh 4x2``, or a baseline's layout."""
    return baselines.describe_layout(layout)


class _Reporter:
    """Turns the search's state into :class:`SearchProgress` reports (no-op without a callback)."""

    def __init__(self, fn, t0: float, total: int):
        self.fn, self.t0, self.total = fn, t0, total

    def __call__(self, phase: str, candidate: str, done: int, incumbent_ns: int | None, bound_ns: int | None):
        if self.fn is not None:
            self.fn(SearchProgress(phase, candidate, done, self.total,
                                   None if incumbent_ns is None else incumbent_ns / NS,
                                   None if bound_ns is None else bound_ns / NS, time.perf_counter() - self.t0))


def _least(*xs: int | None) -> int | None:
    known = [x for x in xs if x is not None]
    return min(known) if known else None


def _lower_bound(incumbent: int | None, rest: list[int | None]) -> int | None:
    """A lower bound on the search's result: min(the incumbent, the bounds of the candidates
    still unsolved), or None while one of those has no bound (or nothing is known)."""
    return None if None in rest else _least(incumbent, *rest)


class _CpsatWatch:
    """CP-SAT's reports on candidate ``i`` (``solver.solve(on_progress=)``), as ``"cpsat"``
    progress: its best solution so far against the incumbent, its best bound (never below
    elimination's) against the candidates after it."""

    def __init__(self, report: _Reporter, name: str, i: int, incumbent: int | None, rest: list[int | None]):
        self.report, self.name, self.i, self.incumbent, self.rest = report, name, i, incumbent, rest
        self.objective, self.bound = None, rest[i]

    def __call__(self, objective: int | None, bound: int | None):
        self.objective = _least(self.objective, objective)
        if bound is not None:
            self.bound = max(self.bound or 0, bound)
        inc = _least(self.incumbent, self.objective)
        self.report("cpsat", self.name, self.i, inc, _lower_bound(inc, [self.bound, *self.rest[self.i + 1:]]))


# Two plans whose modelled step times differ by less than this fraction are equally fast
# to the search (the model's error against measured runs is percents; a kept-gathered
# variant that saves a few nanoseconds on a norm's gather while charging megabytes is no
# faster a plan): the one with the lower modelled peak wins.
TIE_TOLERANCE = 1e-4


def _better(a, b) -> bool:
    """Whether candidate ``a`` (objective ns, shape index, plan) beats ``b``."""
    if abs(a[0] - b[0]) <= TIE_TOLERANCE * min(a[0], b[0]):
        pa, pb = a[2].peak_memory_bytes, b[2].peak_memory_bytes
        if pa != pb:
            return pa < pb
    return a[:2] < b[:2]


def _least_budget(over: list, least: float, rebuild: Callable, lower: float = math.inf) -> tuple[int, int]:
    """``(smallest, lower)``: the smallest per-device budget any of the ``over`` points fits
    (none beats ``least``, already known, whose proven bound is ``lower``), and its proven
    lower bound (the same where CP-SAT proved every least peak it was asked): each point's
    least peak (``least_memory``), in the order of their cheap lower bounds, stopping at the
    first bound no lower than the best so far (the rest can only need more). ``rebuild(shape,
    hints)`` gives a point's (builder, problem) again (not kept from the first phase: a search
    that finds a plan never needs them). Each point computed has its entry's
    ``min_budget_bytes`` filled in (and ``min_budget_lower_bytes`` where unproven)."""
    lower = min(lower, least)
    for bound, _, s, h, entry in sorted(over, key=lambda o: o[:2]):
        if bound >= least:
            break
        b, problem = rebuild(s, h)
        low, need = least_memory(b.add_memory_edges(problem))
        low = min(need, max(low, bound))   # (its cheap bound, over the budget, may be the tighter)
        entry["min_budget_bytes"] = need
        if low < need:
            entry["min_budget_lower_bytes"] = low
        least, lower = min(least, need), min(lower, low)
    return int(least), int(lower)


def _cost_models(cl) -> Callable:
    """``cost_model(shape)`` for one search: one :class:`CostModel` per mesh shape, so every
    problem built on a shape (each family, hint and recomputation rung) shares its memo
    (``CostModel.memo``)."""
    made: dict = {}

    def cost_model(s: tuple[int, ...]) -> CostModel:
        cm = made.get(s)
        if cm is None:
            cm = made[s] = CostModel(cl, s)
        return cm
    return cost_model


def _points(points, facts, temporal: bool, recompute, recompute_layers):
    """``(index, mesh shape, hints, layout)`` of each point as the search builds it: temporal
    families off where asked, a recomputation level given to every point."""
    for idx, (s, h, layout) in enumerate(points):
        if not temporal:
            h = dataclasses.replace(h, temporal=False)  # (the caller's Hints stay as they were)
        if recompute is not None:
            # (the count given, else the point's own where the level keeps one)
            count = recompute_layers if recompute_layers is not None else (
                h.recompute_layers if recompute in ("full", "selective") else None)
            h = dataclasses.replace(h, recompute=recompute, recompute_layers=count)
            layout = {**layout, "recompute": recompute} if recompute != "none" else layout
            if count is not None and count < len(facts.recomputed):  # (fewer than every layer)
                layout = {**layout, "recompute_layers": count}
        yield idx, s, h, layout


def _rungs(h: Hints, layout: dict, facts):
    """The recomputation ladder of a point whose budget binds: ``(hints, layout)`` per level
    and count of leading layers."""
    for level in ("selective", "full"):
        for k in recompute_counts(len(facts.recomputed)):
            yield (dataclasses.replace(h, recompute=level, recompute_layers=k),
                   {**layout, "recompute": level, **({"recompute_layers": k} if k else {})})


def fits_budget(tg: TracedGraph, mesh, cluster="cpu-local", budget_bytes: float | None = None,
                hints: str | Hints | None = None, temporal: bool = True, optimizer_layout: str = "fp32-adam",
                recompute: str | None = None, recompute_layers: int | None = None,
                optimizer_impl: str = "foreach", grad_bucket_bytes: float | None = GRAD_BUCKET_BYTES) -> bool:
    """Whether :func:`search` with the same arguments finds a plan that fits ``budget_bytes``
    (rather than raising :class:`InfeasibleBudget`), decided at the first proof instead of
    by finding the fastest plan: the points of the same space (the recomputation ladder's
    rungs where a point's budget binds), each out at once where its cheap memory bound is
    over the budget, and in when its memory-blind optimum fits; then the Lagrangian
    relaxation's minimisers of the rest (one that fits in truth is a plan); then whether any
    assignment of each fits (``fits_memory``, a CP-SAT solve of the memory rows alone), in
    the order of their bounds. What a depth search asks at every depth it tries
    (``python -m stpc bench primepar``), where a budget-bound search's CP-SAT solves take
    minutes."""
    memory = MemoryModel(optimizer_layout, optimizer_impl=optimizer_impl, grad_bucket_bytes=grad_bucket_bytes)
    if budget_bytes is None:
        return True
    cl = get_cluster(cluster) if isinstance(cluster, str) else cluster
    shape, n = parse_mesh(mesh)
    facts = analyse(tg)
    cost_model = _cost_models(cl)
    bound = []   # (cheap memory bound, order, problem): the points whose memory-blind optimum is over
    with _no_gc():
        for _, s, h, layout in _points(_candidates(hints, shape, n, cl), facts, temporal, recompute,
                                       recompute_layers):
            tries = [h] + ([hr for hr, _ in _rungs(h, layout, facts)] if h.recompute is None else [])
            for k, hk in enumerate(tries):
                try:
                    b, problem = build_problem(tg, cost_model(s), budget_bytes, hk, memory, facts,
                                               edges=False)
                except HintUnsatisfiable:
                    if k == 0:
                        break   # (the search skips the point, its ladder too)
                    continue
                least = min_memory_bound(problem)
                if least > problem.budget:
                    continue
                b.add_edges(problem)
                choice, _, peak = memory_blind_optimum(problem)
                if choice is not None and peak <= problem.budget:
                    return True
                bound.append((least, len(bound), problem))
        bound.sort(key=lambda t: t[:2])
        if any(lagrangian.relax(problem).choice is not None for _, _, problem in bound):
            return True
        return any(fits_memory(problem) for _, _, problem in bound)


def _search(tg, mesh, cluster, budget_bytes, hints, temporal, dtype, memory, progress=None,
            recompute=None, time_limit_s=TIME_LIMIT_S, recompute_layers=None) -> Plan:
    t0 = time.perf_counter()
    cl = get_cluster(cluster) if isinstance(cluster, str) else cluster
    shape, n = parse_mesh(mesh)
    facts = analyse(tg)  # (done by ``stpc.trace``: mesh-independent)
    cost_model = _cost_models(cl)
    tried, infeasible, candidates, unresolved = [], [], [], []
    over = []  # (memory bound, index, shape, hints, its tried entry): points no assignment of fits
    points = _candidates(hints, shape, n, cl)
    report = _Reporter(progress, t0, len(points))

    def build(idx, s, h, layout, lazy=False) -> bool:
        """Build one point; True if its memory-blind optimum fits the budget. ``lazy``: its
        groups only (False), the edges and the memory-blind optimum waiting for the second
        phase to reach it: each group's least cost summed is a lower bound of every
        assignment's time (edges and shares charge no negative time:
        ``test_planner.test_edges_and_shares_charge_no_negative_time``), which may prune it
        unbuilt."""
        t_shape = time.perf_counter()
        entry = {"mesh": list(s), "layout": layout}
        try:  # groups first: a budget no assignment fits is known before any edge is costed
            b, problem = build_problem(tg, cost_model(s), budget_bytes, h, memory, facts, edges=False)
        except HintUnsatisfiable as e:  # e.g. a forced family this shape cannot run
            tried.append({**entry, "modelled_step_time_s": None, "skipped": str(e), "solve_time_s": 0.0})
            return True
        if budget_bytes is not None and (least := min_memory_bound(problem)) > problem.budget:
            # How little memory this point could do with matters only if no point fits: its
            # exact minimum (every memory edge costed, then a CP-SAT solve: most of a search's
            # time where a few points are over) waits for that (``_least_budget``); until
            # then the entry holds the cheap lower bound.
            tried.append({**entry, "modelled_step_time_s": None, "infeasible": True, "min_budget_bound_bytes": least,
                          "solve_time_s": time.perf_counter() - t_shape})
            over.append((least, idx, s, h, tried[-1]))
            return False
        if lazy:
            cheap = sum(min(c) for c in problem.cost)
            candidates.append(_Shape(idx, s, layout, b, problem, None, cheap, None, time.perf_counter() - t_shape,
                                     0.0, lazy=True))
            return False
        b.add_edges(problem)
        t_built = time.perf_counter()
        choice, bound, peak = memory_blind_optimum(problem)
        c = _Shape(idx, s, layout, b, problem, choice, bound, peak, t_built - t_shape, time.perf_counter() - t_built)
        candidates.append(c)
        return c.fits()

    for idx, s, h, layout in _points(points, facts, temporal, recompute, recompute_layers):
        report("build", _name(layout), idx, None, None)
        # Recomputing the layers makes every assignment slower: it can only win where the
        # budget binds on the point without it (then it is a point of its own). Each rung
        # of the ladder is built lazily (``build``): most are pruned by their groups' least
        # costs (the replay's time is in them) before any edge is costed.
        if not build(idx, s, h, layout) and h.recompute is None:
            for hr, layout_r in _rungs(h, layout, facts):
                build(idx, s, hr, layout_r, lazy=True)
    best = None  # (objective ns, shape index, plan): the fastest wins, ties (``_better``) to the smaller

    def queued(c: _Shape, seq: int) -> tuple:
        # Cheapest bound first (ties: the earlier point, then the earlier built), but every
        # candidate that needs CP-SAT (its memory-blind optimum over the budget, or none)
        # after all that do not: those end in milliseconds (elimination's optimum fits: it is
        # the point's answer; a lazy one is built and goes back in with its own bound), and
        # the incumbent they leave prunes or caps the CP-SAT ones. In bound order alone,
        # llama-tiny on 4 under a budget just above selective recomputation's peak solved
        # the two points without recomputation first (15 s of CP-SAT, each optimum 3-5x its
        # bound) before the rung whose elimination optimum fits and beats both.
        return (not c.lazy and not c.fits(), c.bound, c.index, seq, c)

    queue = [queued(c, seq) for seq, c in enumerate(candidates)]
    heapq.heapify(queue)
    i = -1
    while queue:
        *_, seq, c = heapq.heappop(queue)
        i += 1
        incumbent = None if best is None else best[0]
        # (elimination's bounds and the lazy ones' group sums; None: too wide to eliminate)
        rest = [c.bound if c.choice is not None or c.lazy else None] + [
            x[-1].bound if x[-1].choice is not None or x[-1].lazy else None for x in sorted(queue)]
        report("solve", _name(c.layout), i, incumbent, _lower_bound(incumbent, rest))
        entry = {"mesh": list(c.mesh), "layout": c.layout, "lower_bound_s": c.bound / NS, "build_time_s": c.build_s}
        if best is not None and (c.bound, c.index) >= best[:2] and c.bound > best[0] * (1 + TIE_TOLERANCE):
            tried.append({**entry, "modelled_step_time_s": None, "pruned": True, "solve_time_s": c.bound_s,
                          **({"edges_built": False} if c.lazy else {})})
            continue
        if c.lazy:  # reached unpruned: its edges and memory-blind optimum, then back in the queue
            t_edges = time.perf_counter()
            c.builder.add_edges(c.problem)
            t_built = time.perf_counter()
            c.choice, c.bound, c.peak = memory_blind_optimum(c.problem)
            c.build_s += t_built - t_edges
            c.bound_s, c.lazy = time.perf_counter() - t_built, False
            heapq.heappush(queue, queued(c, seq))
            continue
        t_solve = time.perf_counter()
        if c.fits():
            sol = eliminated(c.problem, c.choice, c.bound, c.peak, c.bound_s)
        else:  # the budget binds on this shape: CP-SAT, capped by the best so far
            cap = c.problem.cap = None if best is None else best[0] - (0 if c.index < best[1] else 1)
            # Its memory rows relaxed (milliseconds a try): a bound above the cap proves no
            # plan here beats the best, which CP-SAT's full model takes seconds to prove; a
            # relaxed minimiser that fits is a plan in hand, which CP-SAT then has to beat
            relaxed = lagrangian.relax(c.problem, cap, at=c.choice)
            if relaxed.bound is not None and cap is not None and relaxed.bound > cap:
                tried.append({**entry, "modelled_step_time_s": None, "pruned": True,
                              "lagrangian_bound_s": relaxed.bound / NS,
                              "solve_time_s": c.bound_s + time.perf_counter() - t_solve})
                continue
            held = None
            if relaxed.choice is not None and (cap is None or relaxed.objective_ns <= cap):
                held = Solution(choice=relaxed.choice, objective_ns=relaxed.objective_ns,
                                peak_bytes=relaxed.peak_bytes, status="FEASIBLE", solve_time_s=0.0,
                                num_variables=sum(len(k) for k in c.problem.cost if len(k) > 1), num_constraints=0,
                                method="lagrangian")
                c.problem.cap = relaxed.objective_ns - 1
            watch = None
            if progress is not None:
                watch = _CpsatWatch(report, _name(c.layout), i, _least(incumbent, held and held.objective_ns),
                                    [None] * i + rest)  # (its bound at [i], the queue's after it)
            try:
                sol = solve(c.problem, method="cpsat", on_progress=watch, time_limit_s=time_limit_s,
                            hint=c.choice)  # (its memory-blind optimum: where CP-SAT starts)
            except NoBetterPlan:
                if held is None:
                    tried.append({**entry, "modelled_step_time_s": None, "pruned": True,
                                  "solve_time_s": c.bound_s + time.perf_counter() - t_solve})
                    continue
                # CP-SAT proved nothing here beats it: optimal, as CP-SAT's own would be (the
                # method says who proved it; the plan's choice came from the relaxation)
                sol = dataclasses.replace(held, status="OPTIMAL", method="cpsat")
            except InfeasibleBudget as e:  # (both memory phases together: past the phases' own bounds)
                infeasible.append(e)
                tried.append({**entry, "modelled_step_time_s": None, "infeasible": True,
                              "min_budget_bytes": e.min_budget, "solve_time_s": c.bound_s + time.perf_counter() - t_solve,
                              **({"min_budget_lower_bytes": e.lower} if e.lower < e.min_budget else {})})
                continue
            except SolverTimeout as e:
                # CP-SAT ran out of time without a solution under the cap: this candidate may
                # hold a better plan, unproven either way. One such candidate must not throw
                # away the plans in hand (under CPU contention the wall-clock limit buys
                # CP-SAT less work): it is recorded, the plan returned says it is not proven
                # optimal, and only a search that found no plan at all fails on it. Its own
                # relaxation's plan, where it found one, stands for it.
                unresolved.append((c, e))
                if held is None:
                    tried.append({**entry, "modelled_step_time_s": None, "unresolved": str(e),
                                  "solve_time_s": c.bound_s + time.perf_counter() - t_solve})
                    continue
                entry["unresolved"] = str(e)
                sol = held
            if sol.status == "FEASIBLE" and sol is not held:
                # CP-SAT's time ran out with a solution under the cap: a better one may be left
                # here, so the search's plan is not proven optimal either
                e = SolverTimeout("FEASIBLE", time_limit_s)
                unresolved.append((c, e))
                entry["unresolved"] = str(e)
            sol.solve_time_s = c.bound_s + time.perf_counter() - t_solve
            c.problem.cap = cap   # (the plan's own problem keeps no cap below the plan itself)
        plan = make_plan(c.builder, c.problem, sol, c.build_s, dtype)
        tried.append({**entry, "modelled_step_time_s": plan.modelled_step_time_s, "pruned": False,
                      "peak_memory_bytes": plan.peak_memory_bytes, "solve_time_s": sol.solve_time_s,
                      "method": sol.method})
        plan.stats["layout"] = c.layout
        if best is None or _better((sol.objective_ns, c.index, plan), best):
            best = (sol.objective_ns, c.index, plan)
    if best is None and unresolved:
        e = unresolved[0][1]
        raise SolverTimeout(e.status, e.time_limit_s, (
            f" on {', '.join(_name(c.layout) for c, _ in unresolved)}, and no other candidate gave a plan. "
            "Fix: rerun on an idle machine or with a longer time limit (the limit is wall-clock: "
            "--solver-time-limit, search(time_limit_s=)), or with a larger memory budget"))
    if best is None and (infeasible or over):
        least, lower = _least_budget(over, min((e.min_budget for e in infeasible), default=math.inf),
                                     lambda s, h: build_problem(tg, cost_model(s), budget_bytes, h, memory,
                                                                facts, edges=False),
                                     min((e.lower for e in infeasible), default=math.inf))
        raise InfeasibleBudget(int(budget_bytes), least, lower)
    if best is None:
        raise HintUnsatisfiable("no mesh shape satisfies the hints (change the hints or the device count): "
                                + "; ".join(t["skipped"] for t in tried if t.get("skipped")))
    report("done", _name(best[2].stats["layout"]), i + 1, best[0], best[0])
    plan = best[2]
    plan.stats["indivisible"] = indivisible(tg, plan.mesh_shape)
    plan.stats["search_time_s"] = time.perf_counter() - t0
    plan.stats["mesh_shapes_tried"] = tried
    plan.stats["solve_time_s"] = sum(t["solve_time_s"] for t in tried)
    # Proven optimal over the searched space: every candidate solved or pruned by a proof,
    # and the chosen one solved to optimality (not a time-limited FEASIBLE).
    plan.stats["unresolved"] = [_name(c.layout) for c, _ in unresolved]
    plan.stats["optimal"] = not unresolved and plan.stats.get("status") == "OPTIMAL"
    return plan
