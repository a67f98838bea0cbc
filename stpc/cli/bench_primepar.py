"""``python -m stpc bench primepar``: stpc against the baselines on PrimePar's models (modelled).

PrimePar (ASPLOS'24) evaluated six models, OPT 6.7B/175B, Llama2 7B/70B and BLOOM 7.1B/176B,
on 4, 8, 16 and 32 V100s. This benchmark plans each (model, devices) cell on each
``--clusters`` entry (default: ``primepar-v100`` in fp16 and ``dgx-h100`` in bf16; mixed
precision Adam, ``optimizer_layout="mixed-adam"``) with stpc's own search and with each
baseline (``megatron``, ``fsdp-tp``, ``spatial``: the best plan of each one's layout space,
``stpc.planner.baselines``), all on the same cost model and memory budget (the cluster's
default, ``Cluster.default_budget_bytes``, or ``--budget-gib``). Every number it prints
is modelled by stpc's cost model; nothing is run.

Per cell: stpc's mesh, strategy families, step time, peak memory and the step split into
compute / exposed communication / hidden communication (``stpc.planner.summary.breakdown``);
per baseline its step time, peak memory and chosen layout; the speedup of stpc against the
best baseline that fits the budget (its step time / stpc's) and the memory ratio against it;
and what PrimePar's P(2^k x 2^k) on the MLP's down projection would cost stpc's plan on its
own mesh shape (``p2x2_probe``: the least, ignoring the budget), or that its shape has no
axis of 4^k devices to run it on.

Reduced depth: at full depth the 70B/175B/176B models fit no 32 x 32 GiB cluster at all
(mixed-precision Adam's model states alone exceed it), and the 7B models fit no 4 V100s.
Where no baseline fits a cell at full depth, the cell is planned, stpc and every baseline
alike, at the greatest depth (``n_layers``, found by binary search) at which the best
baseline fits; the ``layers`` column says so. Each depth tried asks only whether some
baseline's plan fits (``search.fits_budget``: a proof, not the fastest plan, which under a
binding budget takes CP-SAT minutes); the plans are made at the depth found. A cell in
which not even one layer fits any baseline is reported infeasible, with the smallest budget
one layer would need.

Sensitivity: the cells of the first ``--clusters`` entry at the largest ``--sizes`` are
planned again with the inter-node link at each ``--inter-node-gbs`` (GB/s per node, split
evenly over the node's devices, as the presets do).

PrimePar's worked example (``stpc.cli.primepar_example``): where the run has the cell of
OPT-175B on 8 devices of the first ``--clusters`` entry, its fc2 planned under Megatron's
{B, N, N} and PrimePar's {N, P2x2} partitions, each the best plan with it (full effect).

Traced graphs are cached per (model, layers, dtype) within a run. The full run takes hours:
``--checkpoint FILE`` writes each finished job (a model's cells on a cluster, one sensitivity
cell) to FILE as it finishes and takes those already there, so a stopped run resumes
(``stpc.cli.bench_checkpoint``); the report names the code that planned each job.
"""
from __future__ import annotations

import functools
import math
import multiprocessing
import queue
import re
import signal
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from stpc.cli._common import Parser, UsageError, add_flags, meta_trace, verb, write_json
from stpc.cli import primepar_example
from stpc.cli._progress import bar
from stpc.cli.bench_checkpoint import Checkpoint, code_version
from stpc.cost_models import CLUSTERS, Link, bytes_per_param, get_cluster
from stpc.frontend import models
from stpc.planner import InfeasibleBudget, search
from stpc.planner.search import fits_budget
from stpc.planner.baselines import BASELINES, describe_layout, first_layers
from stpc.planner.solver import TIME_LIMIT_S
from stpc.planner.summary import breakdown

PRIMEPAR_MODELS = ("opt-6.7b", "opt-175b", "llama2-7b", "llama2-70b", "bloom-7b1", "bloom-176b")
DEFAULT_SIZES = (4, 8, 16, 32)
DEFAULT_CLUSTERS = ("primepar-v100:fp16", "dgx-h100:bf16")
DTYPES = ("fp16", "bf16", "fp32")
OPTIMIZER_LAYOUT = {"fp16": "mixed-adam", "bf16": "mixed-adam", "fp32": "fp32-adam"}
# Inter-node bandwidths of the sensitivity rows, GB/s per node (the figures: one
# 100 Gb/s NIC per node, and PrimePar's stated 100 GB/s per node).
SENSITIVITY_GBS = (12.5, 100.0)
# How a cell's speedup is worded: above WIN stpc wins, below TIE_LOW it loses, else a tie.
WIN, TIE_LOW = 1.02, 0.98
PRIMEPAR_SOURCE = ("PrimePar, Wang et al., ASPLOS'24, DOI 10.1145/3620666.3651357, as summarised in "
                   "shared/REFERENCES.md")
PRIMEPAR_GEOMEAN_32 = 1.30   # published geo-mean throughput gain over Megatron-LM at 32 GPUs (PRIMEPAR_SOURCE)
GIB = 2**30


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Target:
    """One ``--clusters`` entry: the cluster planned on and the training dtype."""

    cluster: object   # cost_models.Cluster
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.cluster.name} ({self.dtype})"


def parse_target(text: str) -> Target:
    """``CLUSTER:DTYPE`` (a preset or profile path, then fp16 / bf16 / fp32)."""
    name, sep, dtype = text.rpartition(":")
    if not sep or dtype not in DTYPES:
        raise UsageError(f"--clusters entry {text!r} is not CLUSTER:DTYPE",
                         f"give e.g. primepar-v100:fp16 (dtype one of {', '.join(DTYPES)})")
    try:
        return Target(get_cluster(name), dtype)
    except KeyError:
        raise UsageError(f"unknown cluster {name!r}", f"give one of {', '.join(CLUSTERS)}, or a profile .json") from None


def with_inter_node(cluster, gb_per_s_per_node: float):
    """``cluster`` with its inter-node link carrying ``gb_per_s_per_node`` GB/s per node,
    split evenly over the node's devices (the presets' per-device convention), renamed so."""
    bw = gb_per_s_per_node * 1e9 / cluster.devices_per_node
    return replace(cluster, name=f"{cluster.name}, inter-node {gb_per_s_per_node:g} GB/s per node",
                   inter=Link(cluster.inter.alpha_s, bw))


def inter_node_gbs(cluster) -> float:
    """The inter-node bandwidth of ``cluster`` in GB/s per node."""
    return cluster.inter.bw_bytes_per_s * cluster.devices_per_node / 1e9


class TraceCache:
    """Meta-traced graphs by (model, layers, dtype), least recently used dropped past
    ``capacity``; ``seconds`` records each trace's wall time."""

    def __init__(self, batch: int, seq: int, capacity: int = 12):
        self.batch, self.seq, self.capacity = batch, seq, capacity
        self._graphs: OrderedDict = OrderedDict()
        self.seconds: dict = {}

    def get(self, model: str, layers: int, dtype: str):
        key = (model, layers, dtype)
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return self._graphs[key]
        full = models.get_config(model).n_layers
        t0 = time.perf_counter()
        tg, _, _ = meta_trace(model, self.batch, self.seq, dtype, layers=None if layers == full else layers)
        self.seconds[key] = time.perf_counter() - t0
        self._graphs[key] = tg
        while len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        return tg

    def clear(self) -> None:
        self._graphs.clear()


@functools.lru_cache(maxsize=None)
def model_states_bytes(model: str, layers: int, dtype: str) -> float:
    """Weights, gradients and optimizer state of ``model`` at ``layers`` deep, unsharded."""
    with torch.device("meta"):
        n = models.num_params(models.build(model, n_layers=layers))
    return float(n * sum(bytes_per_param(OPTIMIZER_LAYOUT[dtype])))


# ----------------------------------------------------------------------------- planning


def plan_or_none(tg, n: int, cluster, budget: float, hints: str | None, dtype: str):
    """(plan, None) if a plan fits the budget, else (None, the InfeasibleBudget)."""
    try:
        return search(tg, n, cluster, budget_bytes=budget, hints=hints, dtype=dtype,
                      optimizer_layout=OPTIMIZER_LAYOUT[dtype]), None
    except InfeasibleBudget as e:
        return None, e


_DOWN_PROJECTION = re.compile(r"\.(fc2|down_proj)$")   # the MLP's second linear, by module path


def p2x2_probe(plan) -> dict:
    """What PrimePar's P(2^k x 2^k) would do to ``plan`` (stpc's own, for a cell): the best plan
    on the plan's own mesh shape in which the MLP's down projection (its first layer's and so
    every tied layer's) runs P2x2, the rest re-solved, ignoring the memory budget
    (``plan.solved.best_where``, as ``plan.explain`` ranks; a lower bound of the budgeted
    optimum, so the step it gives is the least that partition costs). ``available``: whether
    the mesh has an axis of 4^k devices at all; ``chosen``: the plan already runs it."""
    mesh = tuple(plan.mesh_shape)
    if not any(n >= 4 and math.isqrt(n) ** 2 == n for n in mesh):
        return {"available": False}
    names = [k for k, n in plan.nodes.items() if n.op == "linear.default" and _DOWN_PROJECTION.search(n.module)]
    if not names:
        return {"available": True, "node": None}
    sv = plan.solved
    g = sv.group_of(names[0])[1]
    if sv.b.groups[g].strategies[sv.choice[g]].kind == "p2x2":
        return {"available": True, "node": names[0], "chosen": True}
    alt = sv.best_where(g, lambda s: s.kind == "p2x2", exact_budget=False)
    if alt is None:
        return {"available": True, "node": names[0], "chosen": False, "step_s": None}
    return {"available": True, "node": names[0], "chosen": False, "step_s": alt.step_s,
            "ratio": alt.step_s / plan.modelled_step_time_s, "peak_bytes": alt.peak_bytes}


def _folded(module: str) -> str:
    """A module path with its layer indices folded: ``layers.3.mlp.fc2`` -> ``layers.*.mlp.fc2``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def p2x2_modules(plan) -> list[str]:
    """The module paths of the ops ``plan`` runs P(2x2), layer indices folded (``layers.*``)."""
    return sorted({_folded(n.module) for n in plan.nodes.values() if n.role == "decision" and n.kind == "p2x2"})


def p2x2_reasons(plan, time_limit_s: float = 20.0) -> list[dict]:
    """Why ``plan`` runs each of its P(2x2) ops (``plan.explain``'s full effect): per op (module
    path, layer indices folded; tied copies once), the best plan in which it takes any other
    strategy, re-solved under the budget, and its step time against ``plan``'s."""
    sv, out, seen = plan.solved, [], set()
    if sv is None:
        return out
    for name, n in plan.nodes.items():
        if n.role != "decision" or n.kind != "p2x2":
            continue
        g = sv.group_of(name)[1]
        if g is None or g in seen:
            continue
        seen.add(g)
        alt = sv.best_where(g, lambda s: s.kind != "p2x2", time_limit_s=time_limit_s)
        out.append({"module": _folded(n.module), "next": alt.label if alt else None,
                    "ratio": alt.step_s / plan.modelled_step_time_s if alt else None,
                    "how": alt.how if alt else "none fits"})
    return out


def plan_record(plan, err, search_s: float) -> dict:
    """What the tables need of one plan (or of its infeasibility)."""
    if plan is None:
        return {"fits": False, "min_budget_bytes": float(err.min_budget), "search_s": search_s}
    split = breakdown(plan) or {}
    return {"fits": True, "mesh": list(plan.mesh_shape), "families": plan.strategy_counts(),
            "layout": describe_layout(plan.stats.get("layout")), "step_s": plan.modelled_step_time_s,
            "peak_bytes": plan.peak_memory_bytes, "compute_s": split.get("compute_s"),
            "exposed_s": split.get("exposed_s"), "hidden_s": split.get("hidden_s"), "search_s": search_s,
            "recompute": plan.stats.get("recompute") or "none",
            "p2x2_modules": p2x2_modules(plan), "p2x2_why": p2x2_reasons(plan),
            "recompute_layers": plan.stats.get("recompute_layers"),
            "optimal": plan.stats.get("optimal", True), "unresolved": plan.stats.get("unresolved", [])}


def best_fitting(baselines: dict[str, dict]) -> str | None:
    """The baseline with the smallest modelled step time among those that fit (None: none fits)."""
    fitting = [(rec["step_s"], name) for name, rec in baselines.items() if rec["fits"]]
    return min(fitting)[1] if fitting else None


def greatest_fitting_depth(fits, full: int) -> int | None:
    """The greatest depth in 1..``full`` at which ``fits(depth)`` holds, by binary search
    (``fits`` must be monotone: true up to some depth, false beyond); None if not even 1."""
    if fits(full):
        return full
    lo, hi = 0, full   # fits(hi) is false; lo is the greatest depth known to fit (0: none yet)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo or None


def compare(cell: dict) -> dict:
    """The cell with its best fitting baseline, the speedup against it (its step time /
    stpc's) and the memory ratio (stpc's peak / its)."""
    best = best_fitting(cell["baselines"])
    stpc = cell["stpc"]
    ok = best is not None and stpc is not None and stpc["fits"]
    base = cell["baselines"][best] if best else None
    return {**cell, "best_baseline": best,
            "speedup": base["step_s"] / stpc["step_s"] if ok else None,
            "memory_ratio": stpc["peak_bytes"] / base["peak_bytes"] if ok else None}


def plan_cell(traces: TraceCache, model: str, n: int, target: Target, budget: float, baselines=BASELINES,
              layers: int | None = None, depth: int | None = None) -> dict:
    """Plan one cell: stpc and every baseline at full depth (``layers``, else the model's
    own), or at the greatest depth at which the best baseline fits; ``depth`` skips that
    search and plans at the depth given."""
    t0 = time.perf_counter()
    full = layers or models.get_config(model).n_layers
    cluster, dtype = target.cluster, target.dtype

    def fits(d: int) -> bool:   # a proof that some plan fits, not the fastest one (``fits_budget``)
        tg = traces.get(model, d, dtype)
        return any(fits_budget(tg, n, cluster, budget, b, optimizer_layout=OPTIMIZER_LAYOUT[dtype]) for b in baselines)

    chosen = depth if depth is not None else greatest_fitting_depth(fits, full)
    cell = {"model": model, "devices": n, "cluster": cluster.name, "dtype": dtype, "budget_bytes": budget,
            "full_layers": full, "layers": chosen, "reduced": chosen is not None and chosen < full,
            "model_states_bytes": model_states_bytes(model, full, dtype)}
    tg = traces.get(model, chosen or 1, dtype)   # an infeasible cell: what one layer would need
    for who in (None, *baselines):
        t1 = time.perf_counter()
        plan, err = plan_or_none(tg, n, cluster, budget, who, dtype)
        rec = plan_record(plan, err, time.perf_counter() - t1)
        if who is None:
            cell["stpc"], cell["baselines"] = rec, {}
            if plan is not None:
                rec["p2x2"] = p2x2_probe(plan)
        else:
            cell["baselines"][who] = rec
    cell["infeasible"] = chosen is None
    cell["wall_s"] = time.perf_counter() - t0
    return compare(cell)


def sensitivity_cells(traces: TraceCache, cell: dict, target: Target, budget: float, gbs: tuple[float, ...],
                      baselines=BASELINES) -> list[dict]:
    """``cell`` (planned on ``target``) re-planned at its own depth with the inter-node link
    at each bandwidth of ``gbs`` (GB/s per node); nothing for an infeasible cell."""
    out = []
    for g in gbs if not cell["infeasible"] else ():
        tweaked = Target(with_inter_node(target.cluster, g), target.dtype)
        rec = plan_cell(traces, cell["model"], cell["devices"], tweaked, budget, baselines, cell["full_layers"],
                        depth=cell["layers"])
        out.append({**rec, "inter_node_gbs_per_node": g})
    return out


def geo_mean(xs: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def verdict(speedup: float) -> str:
    return "wins" if speedup > WIN else ("loses" if speedup < TIE_LOW else "ties")


def why(cell: dict) -> str:
    """Why stpc's plan wins, ties or loses against the best fitting baseline, from what the
    two plans are (families, layouts), in a few words."""
    s, best = cell["stpc"], cell["best_baseline"]
    if cell["speedup"] is None:
        return "-"
    temporal = [k for k in s["families"] if k not in ("spatial", "replicate-fallback")]
    if temporal:
        return (f"{', '.join(temporal)} on {sum(s['families'][k] for k in temporal)} ops: ring transfers under "
                f"their steps' GEMMs ({_s(s['hidden_s'])} s hidden in all)")
    if cell["speedup"] < TIE_LOW:
        return f"{best}'s plan is outside stpc's own space"
    if best == "spatial" or cell["speedup"] <= WIN:
        return "no temporal family pays here: stpc's plan is a spatial one, as good as " + best + "'s"
    return f"a spatial layout outside {best}'s space ({s['layout']})"


# ----------------------------------------------------------------------------- report


def _s(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.1f}"


def layers_text(cell: dict) -> str:
    if cell["infeasible"]:
        return f"infeasible: not 1 of {cell['full_layers']} fits a baseline (1 layer shown)"
    return f"{cell['layers']} of {cell['full_layers']}" + (" (reduced)" if cell["reduced"] else "")


def _plan_cells(rec: dict, layout: bool) -> list[str]:
    if not rec["fits"]:
        return [f"over budget (needs {_gib(rec['min_budget_bytes'])} GiB)", "-"] + (["-"] if layout else [])
    return [_s(rec["step_s"]), _gib(rec["peak_bytes"])] + ([rec["layout"]] if layout else [])


def cell_row(c: dict, baselines, extra: list[str] = ()) -> str:
    s = c["stpc"]
    if s["fits"] and c["infeasible"]:
        head = [f"1 layer fits (peak {_gib(s['peak_bytes'])} GiB)"] + ["-"] * 6
    elif s["fits"]:
        fams = ", ".join(f"{k} {v}" for k, v in s["families"].items())
        head = [s["layout"] or "x".join(map(str, s["mesh"])), fams, _s(s["step_s"]), _gib(s["peak_bytes"]),
                _s(s["compute_s"]),
                _s(s["exposed_s"]), _s(s["hidden_s"])]
    else:
        head = [f"over budget (needs {_gib(s['min_budget_bytes'])} GiB)"] + ["-"] * 6
    cols = [c["model"], *extra, str(c["devices"]), layers_text(c), *head]
    for b in baselines:
        cols += _plan_cells(c["baselines"][b], layout=True)
    cols += [c["best_baseline"] or "none fits", _s(c["speedup"], ".2f") + ("x" if c["speedup"] else ""),
             _s(c["memory_ratio"], ".2f"), why(c)]
    return "| " + " | ".join(cols) + " |"


def table_head(baselines, extra: list[str] = ()) -> list[str]:
    cols = ["model", *extra, "devices", "layers", "stpc layout", "stpc families", "stpc step s", "stpc peak GiB",
            "compute s", "exposed comm s", "hidden comm s"]
    for b in baselines:
        cols += [f"{b} step s", f"{b} peak GiB", f"{b} layout"]
    cols += ["best fitting baseline", "speedup vs best fitting baseline (modelled)", "memory stpc / best baseline",
             "why"]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def cell_on_devices(c: dict) -> str:
    """A cell as the tables' sentences name it: its model and device count."""
    return f"{c['model']} on {c['devices']}"


def cell_at_bandwidth(c: dict) -> str:
    """A sensitivity cell (every one at the largest device count) by its inter-node bandwidth."""
    return f"{c['model']} at {c['inter_node_gbs_per_node']:g} GB/s per node"


def summary_lines(cells: list[dict], top: int) -> list[str]:
    """The geo-mean at ``top`` devices beside PrimePar's, the memory ratio, and which cells
    stpc wins, ties or loses."""
    at_top = [c for c in cells if c["devices"] == top and c["speedup"] is not None]
    gm = geo_mean([c["speedup"] for c in at_top])
    gm_mem = geo_mean([c["memory_ratio"] for c in at_top])
    # PrimePar compares with Megatron-LM alone: the same figure against the megatron baseline, where it fits
    vs_meg = [c["baselines"]["megatron"]["step_s"] / c["stpc"]["step_s"] for c in cells
              if c["devices"] == top and "megatron" in c["baselines"] and c["baselines"]["megatron"]["fits"]
              and c["stpc"]["fits"] and not c["infeasible"]]
    lines = [f"Geo-mean speedup at {top} devices against the best fitting baseline (modelled): "
             f"{_s(gm, '.3f')}x over {len(at_top)} cells; against the megatron baseline alone, PrimePar's "
             f"comparison: {_s(geo_mean(vs_meg), '.3f')}x over {len(vs_meg)} cells. PrimePar's published geo-mean "
             f"at 32 GPUs is {PRIMEPAR_GEOMEAN_32:.2f}x over Megatron-LM, measured ({PRIMEPAR_SOURCE}). Geo-mean "
             f"memory stpc / best baseline at {top} devices: {_s(gm_mem, '.3f')}.", ""]
    by = {"wins": [], "ties": [], "loses": []}
    for c in cells:
        if c["speedup"] is not None:
            by[verdict(c["speedup"])].append(f"{cell_on_devices(c)} ({c['speedup']:.2f}x)")
    none = [cell_on_devices(c) for c in cells if c["speedup"] is None]
    words = {"wins": f"wins (> {WIN:g}x)", "ties": f"ties ({TIE_LOW:g}-{WIN:g}x)", "loses": f"loses (< {TIE_LOW:g}x)"}
    text = "; ".join(f"stpc {words[k]} in {len(v)}" + (f": {', '.join(v)}" if v else "") for k, v in by.items())
    if none:
        text += f"; no comparison in {len(none)} (nothing fits, or stpc does not): {', '.join(none)}"
    return lines + [text + "."]


def recompute_line(cells: list[dict], baselines) -> list[str]:
    """Which cells' plans recompute their layers, and at which level (``Hints.recompute``:
    the search tries selective, then full, where the plan without it does not fit)."""
    def levels(rec_of) -> str:
        by = {"selective": [], "full": []}
        for c in cells:
            rec = rec_of(c)
            if rec and rec.get("fits") and rec.get("recompute", "none") in by:
                first = f", {first_layers(rec['recompute_layers'])}" if rec.get("recompute_layers") else ""
                by[rec["recompute"]].append(f"{cell_on_devices(c)}{first}")
        return "; ".join(f"{k} in {len(v)}" + (f" ({', '.join(v)})" if v else "") for k, v in by.items())
    text = f"Recomputation of the layers: stpc's plan {levels(lambda c: c['stpc'])}; none in the other cells."
    for b in baselines:
        text += f" {b}: {levels(lambda c, b=b: c['baselines'].get(b))}."
    return [text, ""]


def p2x2_line(cells: list[dict]) -> list[str]:
    """Per cell, what P2x2 on the MLP's down projection costs stpc's plan (``p2x2_probe``),
    or why it is not there to try."""
    chosen, costs, faster, none, ops = [], [], [], [], []
    for c in cells:
        own = {} if c["infeasible"] else (c["stpc"] or {})
        if own.get("p2x2_why"):
            ops.append(", ".join(f"{w['module']} in {cell_on_devices(c)} ({_why(w)})"
                                 for w in own["p2x2_why"]))
        elif own.get("p2x2_modules"):   # (a cell checkpointed before the reasons were recorded)
            ops.append(f"{', '.join(own['p2x2_modules'])} in {cell_on_devices(c)}")
        probe = own.get("p2x2")
        if probe is None:
            continue
        where = cell_on_devices(c)
        if not probe["available"] or probe.get("node") is None:
            none.append(where)
        elif probe.get("chosen"):
            chosen.append(where)
        elif probe.get("step_s") is not None and probe["ratio"] < 1:   # (then over the budget: the search keeps it out)
            faster.append((probe["ratio"], f"{where} (peak {_gib(probe.get('peak_bytes'))} GiB, budget "
                                           f"{_gib(c.get('budget_bytes'))})"))
        elif probe.get("step_s") is not None:
            costs.append((probe["ratio"], where))
    if not (chosen or costs or faster or none or ops):
        return []
    text = ("P(2x2) on the MLP's down projection (fc2 / down_proj, every layer), the rest re-solved on stpc's own "
            "mesh shape, ignoring the budget (the least it costs, modelled): ")
    parts = []
    if costs:
        parts.append("slower by " + ", ".join(f"{(r - 1) * 100:+.1f}% in {w}" for r, w in sorted(costs)))
    if faster:
        parts.append("faster but over the budget by " + ", ".join(f"{(1 - r) * 100:.1f}% in {w}"
                                                                  for r, w in sorted(faster)))
    if chosen:
        parts.append("chosen in " + ", ".join(chosen))
    if none:
        parts.append(f"not possible in {len(none)} (no mesh axis of 4^k devices in stpc's shape): " + ", ".join(none))
    text += "; ".join(parts) + "."
    if ops:
        text += " The ops stpc's own plans run P(2x2): " + "; ".join(ops) + "."
    return [text, ""]


def _why(w: dict) -> str:
    """One P(2x2) op's margin (``p2x2_reasons``) in words."""
    if w["ratio"] is None:
        return "no other strategy of it fits the budget"
    bound = {"bound": ", a lower bound: over the budget", "feasible": ", CP-SAT's time ran out: an upper bound"}
    return (f"the best plan with it {w['next']} is {(w['ratio'] - 1) * 100:+.2f}%"
            f"{bound.get(w['how'], '')}")


def unproven_line(cells: list[dict], baselines, where=cell_on_devices) -> list[str]:
    """The plans not proven optimal in their space (CP-SAT stopped at its time limit on a
    candidate, or on the chosen one with a solution in hand): a speedup against or of such a
    plan is a bound in one direction only. Nothing when every plan was proven. ``where``
    names a cell (its model and device count; a sensitivity cell's, its bandwidth)."""
    out = []
    for c in cells:
        for who, rec in [("stpc", c["stpc"])] + [(b, c["baselines"].get(b)) for b in baselines]:
            if rec and rec.get("fits") and rec.get("optimal") is False:
                why = (f"CP-SAT ran out of time on {', '.join(rec['unresolved'])}" if rec.get("unresolved")
                       else "its own CP-SAT solve stopped at the time limit")
                out.append(f"{who}'s plan for {where(c)} ({why})")
    if not out:
        return []
    return [f"Not proven optimal (the search's wall-clock limit of CP-SAT, {TIME_LIMIT_S:g} s a candidate, ran out): "
            + "; ".join(out) + ".", ""]


def states_line(cells: list[dict], top: int) -> list[str]:
    """Which models' unsharded model states alone exceed ``top`` devices' budgets (no layout
    fits them at full depth), computed from the parameter counts."""
    total = top * cells[0]["budget_bytes"]
    over = {c["model"]: c["model_states_bytes"] for c in cells if c["model_states_bytes"] > total}
    if not over:
        return []
    return ["At full depth the model states alone (weights, gradients, optimizer state) of "
            + ", ".join(f"{m} ({b / GIB:,.0f} GiB)" for m, b in over.items())
            + f" exceed {top} devices' budgets together ({total / GIB:,.0f} GiB): no layout fits them.", ""]


def report(cfg: dict, cells: list[dict], sens: list[dict], machine: str, command: str, wall_s: float,
           example: dict | None = None, provenance: dict | None = None) -> str:
    baselines = cfg["baselines"]
    top = max(cfg["sizes"])
    budget_note = (f"{cfg['budget_gib']:g} GiB per device (--budget-gib)" if cfg["budget_gib"] else
                   "each cluster's default (device memory x its usable fraction, `Cluster.default_budget_bytes`)")
    lines = ["## PrimePar's models: stpc against the baselines (modelled)", "", f"Command: `{command}`", "",
             machine, "",
             "Every step time, memory figure and speedup below is **modelled** by stpc's cost model on the "
             "named cluster preset; nothing was run. "
             f"Global batch {cfg['batch']} x seq {cfg['seq']}, mixed-precision Adam; memory budget {budget_note}. "
             f"Baselines ({', '.join(baselines)}): the best plan of each one's layout space "
             "(`stpc.planner.baselines`) on the same cost model and budget. Speedup = the best fitting "
             "baseline's modelled step time / stpc's; memory = stpc's modelled peak / that baseline's. "
             "Step split (stpc's plan): compute, exposed communication (in the step), hidden communication "
             "(beside compute, not in the step). Where no baseline fits a cell at full depth, all its plans "
             "are made at the greatest depth at which the best baseline fits (`layers`: \"reduced\").", ""]
    for target_label in dict.fromkeys(f"{c['cluster']} ({c['dtype']})" for c in cells):
        mine = [c for c in cells if f"{c['cluster']} ({c['dtype']})" == target_label]
        lines += [f"### {target_label}, budget {_gib(mine[0]['budget_bytes'])} GiB per device", ""]
        lines += table_head(baselines) + [cell_row(c, baselines) for c in mine] + [""]
        lines += states_line(mine, top)
        lines += recompute_line(mine, baselines)
        lines += p2x2_line(mine)
        lines += unproven_line(mine, baselines)
        lines += summary_lines(mine, top) + [""]
    if sens:
        base = sens[0]["cluster"].split(",")[0]
        lines += [f"### Sensitivity: inter-node bandwidth ({base}, {sens[0]['devices']} devices)", "",
                  f"The same cells with the inter-node link at each bandwidth (GB/s per node, split over the "
                  f"node's devices); the preset itself has {cfg['sensitivity_preset_gbs']:g} GB/s per node.", ""]
        lines += table_head(baselines, ["inter-node GB/s per node"])
        lines += [cell_row(c, baselines, [f"{c['inter_node_gbs_per_node']:g}"]) for c in sens] + [""]
        for g in dict.fromkeys(c["inter_node_gbs_per_node"] for c in sens):
            got = [c["speedup"] for c in sens if c["inter_node_gbs_per_node"] == g and c["speedup"] is not None]
            lines.append(f"At {g:g} GB/s per node: geo-mean speedup {_s(geo_mean(got), '.3f')}x over "
                         f"{len(got)} cells (modelled).")
        lines.append("")
        lines += unproven_line(sens, baselines, where=cell_at_bandwidth)
    if example is not None:
        lines += primepar_example.section(example) + [""]
    jobs = cfg.get("jobs", 1)
    side = f"; {jobs} (model, cluster) pairs at a time, each in its own process" if jobs > 1 else ""
    lines.append(f"Wall time of this run: {wall_s:.0f} s (tracing, depth search and planning{side}).")
    lines += provenance_lines(provenance)
    return "\n".join(lines) + "\n"


def provenance_lines(prov: dict | None) -> list[str]:
    """Which code planned the cells, and which jobs a ``--checkpoint`` file gave (planned by an
    earlier run: their time is not in the wall time above)."""
    if not prov or not prov["codes"]:
        return []
    codes = ", ".join(f"{c} ({n} job{'s' if n != 1 else ''})" for c, n in prov["codes"].items())
    text = f"Planned by stpc {codes}."
    if prov["taken"]:
        text += (f" {prov['taken']} of {prov['taken'] + prov['planned']} jobs were taken from the checkpoint "
                 f"`{prov['path']}`, planned by earlier runs in {prov['taken_wall_s']:.0f} s of one process each "
                 f"in all.")
    return ["", text]


def quiet_line(cfg: dict, cells: list[dict]) -> str:
    top = max(cfg["sizes"])
    parts = []
    for label in dict.fromkeys(f"{c['cluster']} ({c['dtype']})" for c in cells):
        got = [c["speedup"] for c in cells
               if f"{c['cluster']} ({c['dtype']})" == label and c["devices"] == top and c["speedup"] is not None]
        parts.append(f"{label}: {_s(geo_mean(got), '.3f')}x")
    return f"geo-mean speedup at {top} devices vs best fitting baseline (modelled): " + "; ".join(parts)


# ----------------------------------------------------------------------------- verb


def budget_of(cfg: dict, target: Target) -> float:
    return cfg["budget_gib"] * GIB if cfg["budget_gib"] else target.cluster.default_budget_bytes


def plan_model(cfg: dict, model: str, ti: int, traces: TraceCache | None = None) -> list[dict]:
    """One model's cells on ``cfg["clusters"][ti]``, every size."""
    traces = traces or TraceCache(cfg["batch"], cfg["seq"])
    t = parse_target(cfg["clusters"][ti])
    return [plan_cell(traces, model, n, t, budget_of(cfg, t), cfg["baselines"], cfg["layers"]) for n in cfg["sizes"]]


# A job is ("cells", model, cluster index): that model's cells on that cluster, every size; or
# ("sensitivity", model, GB/s): its cell at the largest size on the first cluster, re-planned
# with that inter-node bandwidth (so it waits for that cell).


def job_key(cfg: dict, job: tuple) -> dict:
    """Everything a job's result depends on (a ``--checkpoint`` record's key)."""
    kind, model, arg = job
    common = {"kind": kind, "model": model, "batch": cfg["batch"], "seq": cfg["seq"], "layers": cfg["layers"],
              "budget_gib": cfg["budget_gib"], "baselines": cfg["baselines"]}
    if kind == "cells":
        return {**common, "cluster": cfg["clusters"][arg], "sizes": cfg["sizes"]}
    return {**common, "cluster": cfg["clusters"][0], "devices": max(cfg["sizes"]), "inter_node_gbs": arg}


def run_job(cfg: dict, job: tuple, top_cell: dict | None, traces: TraceCache) -> list[dict]:
    kind, model, arg = job
    if kind == "cells":
        return plan_model(cfg, model, arg, traces)
    t = parse_target(cfg["clusters"][0])
    return sensitivity_cells(traces, top_cell, t, budget_of(cfg, t), (arg,), cfg["baselines"])


_WORKER_TRACES: dict = {}   # a worker process's traces, kept across its jobs


def _job_in_worker(cfg: dict, job: tuple, top_cell: dict | None) -> tuple[list[dict], float]:
    traces = _WORKER_TRACES.setdefault((cfg["batch"], cfg["seq"]), TraceCache(cfg["batch"], cfg["seq"]))
    t0 = time.perf_counter()
    return run_job(cfg, job, top_cell, traces), time.perf_counter() - t0


class _Inline:
    """The pool's interface in this process (``--jobs 1``): each ``next_done`` runs the next
    job submitted, one model's traces reused."""

    def __init__(self, cfg: dict):
        self.traces, self.queue = TraceCache(cfg["batch"], cfg["seq"]), []

    def submit(self, cfg, job, top_cell):
        self.queue.append((cfg, job, top_cell))

    def next_done(self):
        cfg, job, top_cell = self.queue.pop(0)
        t0 = time.perf_counter()
        return job, run_job(cfg, job, top_cell, self.traces), time.perf_counter() - t0

    def __bool__(self):
        return bool(self.queue)


class _Pool:
    """``jobs`` spawned processes; ``next_done`` waits for whichever job finishes first, and
    ``close`` ends the processes (a stopped run leaves none behind)."""

    def __init__(self, jobs: int):
        self.pool = multiprocessing.get_context("spawn").Pool(jobs)
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0
        # a SIGTERM (kill, a job scheduler) ends the run through ``close`` too: by default it
        # would end this process alone, its workers planning on
        self._term = None
        if threading.current_thread() is threading.main_thread():
            self._term = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def submit(self, cfg, job, top_cell):
        self.pending += 1
        self.pool.apply_async(_job_in_worker, (cfg, job, top_cell),
                              callback=lambda out, job=job: self.finished.put((job, out, None)),
                              error_callback=lambda e, job=job: self.finished.put((job, None, e)))

    def next_done(self):
        job, out, error = self.finished.get()
        self.pending -= 1
        if error is not None:
            raise error
        return job, *out

    def __bool__(self):
        return self.pending > 0

    def close(self):
        self.pool.terminate()
        self.pool.join()
        if self._term is not None:
            signal.signal(signal.SIGTERM, self._term)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def run(cfg: dict, targets: list[Target], progress: bool = False, jobs: int = 1,
        checkpoint: Checkpoint | None = None) -> tuple[list[dict], list[dict]]:
    """Every cell, then the sensitivity cells, in the same order however many ``jobs`` plan
    them (a CP-SAT solve cut at its time limit aside: what it had found by then depends on the
    machine's load). One job: model-major, so one model's traces are reused. More: each
    (model, cluster) pair is a job of its own process, the largest models first (the pairs'
    times differ by orders of magnitude; the solver is single-threaded, so a process a core),
    each sensitivity cell a job queued once its model's cell is planned. A job found in
    ``checkpoint`` is taken from it; each one planned is appended to it as it finishes."""
    checkpoint = checkpoint or Checkpoint(None)
    code = code_version()
    pairs = [("cells", m, ti) for m in cfg["models"] for ti in range(len(targets))]
    if jobs > 1:
        pairs.sort(key=lambda j: -model_states_bytes(j[1], models.get_config(j[1]).n_layers, "fp32"))
    sens_models = [m for m in cfg["models"] if m in cfg.get("sensitivity_models", cfg["models"])]
    sens_of = {m: [("sensitivity", m, g) for g in cfg["inter_node_gbs"]] for m in sens_models}
    n_sens = sum(map(len, sens_of.values()))
    steps = bar(len(pairs) * len(cfg["sizes"]) + n_sens, "[bench primepar] cells", progress)
    done: dict[tuple, list[dict]] = {}
    runner = _Inline(cfg) if jobs <= 1 else _Pool(min(jobs, len(pairs) + n_sens))

    def start(job, top_cell=None):
        got = checkpoint.get(job_key(cfg, job))
        if got is not None:
            finish(job, got)
        else:
            runner.submit(cfg, job, top_cell)

    def finish(job, result):
        done[job] = result
        steps.update(len(cfg["sizes"]) if job[0] == "cells" else 1)
        if job[0] == "cells" and job[2] == 0:
            top = result[-1]    # sizes are sorted: the largest size's cell
            for sj in sens_of.get(job[1], ()):
                start(sj, top)

    try:
        for job in pairs:
            start(job)
        while runner:
            job, result, wall = runner.next_done()
            checkpoint.put(job_key(cfg, job), result, wall, code)
            steps.set_postfix_str(f"{job[1]} ({job[0]}) done", refresh=False)
            finish(job, result)
    finally:
        if isinstance(runner, _Pool):
            runner.close()
    steps.close()
    # table by table, then model and size as given; sensitivity rows in model order
    cells = [c for ti in range(len(targets)) for m in cfg["models"] for c in done["cells", m, ti]]
    sens = [r for m in sens_models for sj in sens_of[m] for r in done[sj]]
    return cells, sens


def run_example(cfg: dict, cells: list[dict], target: Target, checkpoint: Checkpoint | None = None) -> dict | None:
    """PrimePar's worked example (``primepar_example``) on ``target`` at the depth its cell
    (opt-175b on 8 devices) was planned at; None where the run has no such cell or it fits
    nothing. A job of ``checkpoint`` like the cells."""
    cell = next((c for c in cells if c["model"] == primepar_example.MODEL and c["devices"] == primepar_example.DEVICES
                 and c["cluster"] == target.cluster.name and c["dtype"] == target.dtype and not c["infeasible"]), None)
    if cell is None:
        return None
    checkpoint = checkpoint or Checkpoint(None)
    key = {"kind": "example", "model": primepar_example.MODEL, "devices": primepar_example.DEVICES,
           "cluster": f"{target.cluster.name}:{target.dtype}", "layers": cell["layers"], "batch": cfg["batch"],
           "seq": cfg["seq"], "budget_gib": cfg["budget_gib"]}
    got = checkpoint.get(key)
    if got is None:
        t0 = time.perf_counter()
        got = primepar_example.worked_example(TraceCache(cfg["batch"], cfg["seq"]), target, budget_of(cfg, target),
                                              cell["layers"], OPTIMIZER_LAYOUT[target.dtype])
        checkpoint.put(key, got, time.perf_counter() - t0, code_version())
    return got


@verb
def main_primepar(argv: list[str], machine_line, write_section) -> int:
    ap = Parser("python -m stpc bench primepar", __doc__)
    add_flags(ap, {"layers": {"shown": "each model's own", "note": "every model cut to N layers (a smaller run)"},
                   "batch": {"default": 8}, "seq": {"default": 2048},
                   "budget-gib": {"shown": "each cluster's default_budget_bytes"},
                   "json": {"shown": "none", "note": "one record per cell, and the sensitivity cells"}})
    ap.add_argument("--models", nargs="+", default=list(PRIMEPAR_MODELS), metavar="MODEL",
                    help="zoo models (default: PrimePar's six)")
    ap.add_argument("--sizes", nargs="+", type=int, default=list(DEFAULT_SIZES), metavar="N",
                    help="device counts (default: %(default)s)")
    ap.add_argument("--clusters", nargs="+", default=list(DEFAULT_CLUSTERS), metavar="CLUSTER:DTYPE",
                    help="what to plan on, each CLUSTER:DTYPE (default: %(default)s)")
    ap.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=list(BASELINES),
                    help="baselines to compare with (default: all)")
    ap.add_argument("--inter-node-gbs", nargs="*", type=float, default=list(SENSITIVITY_GBS), metavar="GBS",
                    help="sensitivity rows: inter-node GB/s per node, on the first --clusters entry at the largest "
                         "--sizes (default: %(default)s; none: no sensitivity rows)")
    ap.add_argument("--sensitivity-models", nargs="+", metavar="MODEL",
                    help="the models given sensitivity rows (default: every --models entry)")
    ap.add_argument("--checkpoint", metavar="FILE",
                    help="append each finished job (a model's cells on a cluster; a sensitivity cell) to FILE as it "
                         "finishes, and take the jobs FILE already has instead of planning them again: a stopped run "
                         "resumes where it stopped (JSON lines; stpc.cli.bench_checkpoint)")
    ap.add_argument("--results", help="regenerate this markdown file's primepar section (e.g. benchmarks/RESULTS.md)")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="plan N (model, cluster) pairs at once, each in its own process (default: %(default)s; "
                         "the same cells whatever N, unless a CP-SAT solve reaches its time limit: the solver is "
                         "single-threaded and deterministic)")
    args = ap.parse_args(argv)
    for m in args.models + (args.sensitivity_models or []):
        if m not in models.CONFIGS:
            ap.error(f"unknown model {m!r}; known: {', '.join(sorted(models.CONFIGS))}. Fix: give zoo names")
    if min(args.sizes) < 1 or any(g <= 0 for g in args.inter_node_gbs) or args.jobs < 1:
        ap.error("--sizes, --inter-node-gbs and --jobs must be positive. Fix: give e.g. --sizes 4 8 16 32")
    targets = [parse_target(t) for t in args.clusters]
    for t in targets:
        if max(args.sizes) > t.cluster.num_devices:
            raise UsageError(f"--sizes {max(args.sizes)} exceeds {t.cluster.name}'s {t.cluster.num_devices} devices",
                             "give smaller --sizes, or a larger cluster")
    cfg = {"models": args.models, "sizes": sorted(args.sizes), "clusters": args.clusters, "baselines": args.baselines,
           "batch": args.batch, "seq": args.seq, "layers": args.layers, "budget_gib": args.budget_gib,
           "inter_node_gbs": args.inter_node_gbs, "sensitivity_preset_gbs": inter_node_gbs(targets[0].cluster),
           "jobs": args.jobs, "sensitivity_models": args.sensitivity_models or args.models}
    t0 = time.perf_counter()
    checkpoint = Checkpoint(args.checkpoint)
    cells, sens = run(cfg, targets, progress=not args.quiet, jobs=args.jobs, checkpoint=checkpoint)
    example = run_example(cfg, cells, targets[0], checkpoint)
    wall = time.perf_counter() - t0
    command = ("python -m stpc bench primepar " + " ".join(argv)).strip()
    text = report(cfg, cells, sens, machine_line(), command, wall, example, checkpoint.provenance())
    print(quiet_line(cfg, cells) if args.quiet else text)
    if args.json:
        write_json(args.json, {"config": cfg, "cells": cells, "sensitivity": sens, "example": example, "wall_s": wall,
                               "provenance": checkpoint.provenance(),
                               "primepar_geomean_32": {"value": PRIMEPAR_GEOMEAN_32, "source": PRIMEPAR_SOURCE}})
    if args.results:
        write_section(args.results, "primepar", text)
    return 0


__all__ = ["main_primepar", "run_example", "plan_cell", "best_fitting", "greatest_fitting_depth", "compare", "TraceCache",
           "parse_target", "with_inter_node", "geo_mean", "report", "run", "plan_model", "why", "PRIMEPAR_MODELS", "Target"]
