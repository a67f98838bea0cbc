"""``python -m stpc bench planner``: how long planning takes, beside PrimePar's and AutoParallel's.

For each of PrimePar's models (``--models``) at full depth, traced once on meta tensors
(timed: ``torch.export``, annotation and the mesh-independent analysis), then on each device
count (``--sizes``) searched ``--repeat`` times with stpc's own search (every logical mesh
shape: strategy enumeration, costing, solving, reading the plan back) on ``--cluster``
(default ``primepar-v100`` in fp16, PrimePar's testbed) under its default memory budget.
Reported: the trace, the first (cold) search, the median search, and the total one ``stpc
plan`` call pays (trace + first search), beside PrimePar's published search time for that
model family and device count (ms on one Xeon thread). At full depth the 70B/175B/176B
models fit no budget of these clusters: there the search proves infeasibility in a
fraction of a second, which is no search time to compare, so those cells are searched
without a budget (and say so), as the budget does not change the size of the problem.

One more row: ``--large-model`` (default ``llama3-8b``) on ``--large-devices`` (64) of
``--large-cluster`` (``dgx-h100`` in bf16; made larger, and said so, if it has fewer
devices), beside AutoParallel's published end-to-end time for Llama3-8B on 64 GPUs.

Times are wall-clock on this machine (see its line); the search may use more than one
thread (CP-SAT where the budget binds), PrimePar's figures are single-threaded.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

from stpc.cli._common import Parser, UsageError, add_flags, verb, write_json
from stpc.cli._progress import bar
from stpc.cli.bench_primepar import GIB, PRIMEPAR_MODELS, PRIMEPAR_SOURCE, DEFAULT_SIZES, TraceCache, parse_target, \
    plan_or_none
from stpc.frontend import models

# PrimePar's published search times (ms, one Xeon thread) per model family and device count.
PRIMEPAR_SEARCH_MS = {
    "opt": {4: 85, 8: 87, 16: 171, 32: 5357},
    "llama2": {4: 87, 8: 89, 16: 186, 32: 6070},
    "bloom": {4: 85, 8: 80, 16: 166, 32: 4153},
}
AUTOPARALLEL_LLAMA3_8B_64_S = 47   # "ILP build ~15 s + solve ~36 s, ~47 s end to end" (AUTOPARALLEL_SOURCE)
AUTOPARALLEL_SOURCE = "meta-pytorch/autoparallel, Llama3-8B on 64 GPUs (2-D), as summarised in shared/REFERENCES.md"


def primepar_search_s(model: str, n: int) -> float | None:
    """PrimePar's published search time (s) for ``model``'s family on ``n`` devices, if any."""
    family = next((f for f in PRIMEPAR_SEARCH_MS if model.startswith(f)), None)
    ms = PRIMEPAR_SEARCH_MS.get(family, {}).get(n)
    return None if ms is None else ms / 1e3


def time_searches(tg, n: int, target, budget: float | None, repeat: int) -> dict:
    """``repeat`` searches of ``tg`` on ``n`` devices: their times, and the plan's outcome."""
    times, plan, err = [], None, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan, err = plan_or_none(tg, n, target.cluster, budget, None, target.dtype)
        times.append(time.perf_counter() - t0)
    rec = {"first_s": times[0], "median_s": statistics.median(times), "searches_s": times, "fits": plan is not None}
    if plan is not None:
        rec.update(mesh=list(plan.mesh_shape), step_s=plan.modelled_step_time_s, peak_bytes=plan.peak_memory_bytes,
                   optimal=plan.stats.get("optimal", True))
    else:
        rec["min_budget_bytes"] = float(err.min_budget)
    return rec


def time_cell(traces: TraceCache, model: str, n: int, target, budget: float, repeat: int, layers: int | None,
              reference_s: float | None) -> dict:
    """One row: trace (cached per model), searches under the budget, and, where the budget is
    infeasible at this depth, searches without one."""
    depth = layers or models.get_config(model).n_layers
    fresh = (model, depth, target.dtype) not in traces.seconds
    tg = traces.get(model, depth, target.dtype)
    trace_s = traces.seconds[(model, depth, target.dtype)]
    rec = {"model": model, "devices": n, "cluster": target.cluster.name, "dtype": target.dtype, "layers": depth,
           "trace_s": trace_s, "trace_cached": not fresh, "budget_bytes": budget,
           "budgeted": time_searches(tg, n, target, budget, repeat)}
    timed = rec["budgeted"]
    if not timed["fits"]:
        timed = rec["unbudgeted"] = time_searches(tg, n, target, None, repeat)
    rec["search_s"], rec["first_search_s"] = timed["median_s"], timed["first_s"]
    rec["total_s"] = trace_s + timed["first_s"]
    rec["reference_s"] = reference_s
    return rec


def large_target(text: str, devices: int):
    """The ``--large-cluster`` target, its node count raised if it has fewer than ``devices``."""
    t = parse_target(text)
    c = t.cluster
    if c.num_devices >= devices:
        return t, None
    nodes = math.ceil(devices / c.devices_per_node)
    grown = replace(c, name=f"{c.name} x {nodes} nodes", nodes=nodes)
    return replace(t, cluster=grown), f"{c.name} has {c.num_devices} devices: planned on {nodes} of its nodes"


def _s(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def row(r: dict, within: bool | None = None) -> str:
    """One table row; ``within``: the "<= reference" column (default: median search <= reference)."""
    ref = r["reference_s"]
    if within is None and ref is not None:
        within = r["search_s"] <= ref
    b = r["budgeted"]
    if b["fits"]:
        outcome = f"planned: mesh {'x'.join(map(str, b['mesh']))}, peak {b['peak_bytes'] / GIB:.1f} GiB"
        if b.get("optimal") is False:  # (CP-SAT's wall-clock limit ran out on a candidate: the time includes it)
            outcome += ", not proven optimal (CP-SAT time limit)"
    else:
        u = r["unbudgeted"]
        outcome = (f"infeasible under {r['budget_bytes'] / GIB:.1f} GiB (needs {b['min_budget_bytes'] / GIB:.0f} GiB; "
                   f"proved in {b['median_s']:.3f} s): timed without a budget"
                   + (f", mesh {'x'.join(map(str, u['mesh']))}" if u["fits"] else ""))
    cols = [r["model"], str(r["devices"]), f"{r['cluster']} ({r['dtype']})", str(r["layers"]),
            _s(r["trace_s"], ".2f") + (" (cached)" if r["trace_cached"] else ""), _s(r["first_search_s"]),
            _s(r["search_s"]), _s(r["total_s"], ".2f"), _s(ref, "g"), "-" if within is None else ("yes" if within else "no"),
            outcome]
    return "| " + " | ".join(cols) + " |"


def report(cfg: dict, rows: list[dict], large: dict | None, large_note: str | None, machine: str,
           command: str) -> str:
    lines = ["## Planner: search time (measured on this machine)", "", f"Command: `{command}`", "", machine, "",
             f"Global batch {cfg['batch']} x seq {cfg['seq']}, mixed-precision Adam, each cluster's default memory "
             f"budget. Trace: build on meta + `torch.export` + annotation + analysis (once per model; later "
             f"rows reuse it, marked cached). Search: stpc's own search over every mesh shape, the median of "
             f"{cfg['repeat']} runs; first: the first (cold) run; total: trace + first search, what one "
             f"`python -m stpc plan` call pays. PrimePar's search times are published figures, ms on one Xeon "
             f"thread ({PRIMEPAR_SOURCE}); full-depth models that fit no budget are searched without one "
             f"(the problem is the same size).", "",
             "| model | devices | cluster | layers | trace s | first search s | search s (median) | total s "
             "| PrimePar search s (published) | median <= PrimePar | outcome |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row(r) for r in rows]
    with_ref = [r for r in rows if r["reference_s"] is not None]
    faster = sum(r["search_s"] <= r["reference_s"] for r in with_ref)
    lines += ["", f"Median search at or under PrimePar's published time in {faster} of {len(with_ref)} cells."]
    if large:
        lines += ["", f"### {large['model']} on {large['devices']} devices", "",
                  (large_note + ". " if large_note else "")
                  + f"Beside AutoParallel's published ~{AUTOPARALLEL_LLAMA3_8B_64_S} s end to end "
                  f"({AUTOPARALLEL_SOURCE}).", "",
                  "| model | devices | cluster | layers | trace s | first search s | search s (median) | total s "
                  "| AutoParallel end to end s (published) | total <= AutoParallel | outcome |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines.append(row(dict(large, reference_s=float(AUTOPARALLEL_LLAMA3_8B_64_S)),
                         within=large["total_s"] <= AUTOPARALLEL_LLAMA3_8B_64_S))   # end to end: the total
    return "\n".join(lines) + "\n"


def run(cfg: dict, progress: bool = False) -> tuple[list[dict], dict | None, str | None]:
    target = parse_target(cfg["cluster"])
    budget = target.cluster.default_budget_bytes
    traces = TraceCache(cfg["batch"], cfg["seq"], capacity=1)
    rows = []
    steps = bar(len(cfg["models"]) * len(cfg["sizes"]), "[bench planner] cells", progress)
    for model in cfg["models"]:
        for n in cfg["sizes"]:
            steps.set_postfix_str(f"{model} on {n}", refresh=False)
            rows.append(time_cell(traces, model, n, target, budget, cfg["repeat"], cfg["layers"],
                                  primepar_search_s(model, n)))
            steps.update()
    steps.close()
    large, note = None, None
    if cfg["large_model"] != "none":
        lt, note = large_target(cfg["large_cluster"], cfg["large_devices"])
        large = time_cell(traces, cfg["large_model"], cfg["large_devices"], lt, lt.cluster.default_budget_bytes,
                          cfg["repeat"], None, None)
    return rows, large, note


@verb
def main_planner(argv: list[str], machine_line, write_section) -> int:
    ap = Parser("python -m stpc bench planner", __doc__)
    add_flags(ap, {"layers": {"shown": "each model's own", "note": "every PrimePar model cut to N layers"},
                   "batch": {"default": 8}, "seq": {"default": 2048},
                   "json": {"shown": "none", "note": "one record per cell, and the large-model row"}})
    ap.add_argument("--models", nargs="+", default=list(PRIMEPAR_MODELS), metavar="MODEL",
                    help="zoo models (default: PrimePar's six)")
    ap.add_argument("--sizes", nargs="+", type=int, default=list(DEFAULT_SIZES), metavar="N",
                    help="device counts (default: %(default)s)")
    ap.add_argument("--cluster", default="primepar-v100:fp16", metavar="CLUSTER:DTYPE",
                    help="what the PrimePar cells are planned on (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="searches per cell; the median is reported (default: 3)")
    ap.add_argument("--large-model", default="llama3-8b", help="the large-mesh row's model; none: no such row "
                    "(default: %(default)s)")
    ap.add_argument("--large-devices", type=int, default=64, help="its device count (default: %(default)s)")
    ap.add_argument("--large-cluster", default="dgx-h100:bf16", metavar="CLUSTER:DTYPE",
                    help="its cluster (default: %(default)s)")
    ap.add_argument("--results", help="regenerate this markdown file's planner section (e.g. benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    for m in [*args.models, *([args.large_model] if args.large_model != "none" else [])]:
        if m not in models.CONFIGS:
            raise UsageError(f"unknown model {m!r}", f"give zoo names: {', '.join(sorted(models.CONFIGS))}")
    if args.repeat < 1 or min(args.sizes) < 1 or args.large_devices < 1:
        ap.error("--repeat, --sizes and --large-devices must be at least 1. Fix: give e.g. --repeat 3")
    target = parse_target(args.cluster)
    if max(args.sizes) > target.cluster.num_devices:
        raise UsageError(f"--sizes {max(args.sizes)} exceeds {target.cluster.name}'s {target.cluster.num_devices} "
                         "devices", "give smaller --sizes")
    cfg = {k: getattr(args, k) for k in ("models", "sizes", "cluster", "repeat", "large_model", "large_devices",
                                         "large_cluster", "batch", "seq", "layers")}
    t0 = time.perf_counter()
    rows, large, note = run(cfg, progress=not args.quiet)
    command = ("python -m stpc bench planner " + " ".join(argv)).strip()
    text = report(cfg, rows, large, note, machine_line(), command)
    text += f"\nWall time of this run: {time.perf_counter() - t0:.0f} s.\n"
    if args.quiet:
        print(next(line for line in text.splitlines() if line.startswith("Median search")))
    else:
        print(text)
    if args.json:
        write_json(args.json, {"config": cfg, "cells": rows, "large": large, "large_note": note,
                               "references": {"primepar_search_ms": PRIMEPAR_SEARCH_MS, "primepar": PRIMEPAR_SOURCE,
                                              "autoparallel_llama3_8b_64_s": AUTOPARALLEL_LLAMA3_8B_64_S,
                                              "autoparallel": AUTOPARALLEL_SOURCE}})
    if args.results:
        write_section(args.results, "planner", text)
    return 0


__all__ = ["main_planner", "time_cell", "primepar_search_s", "large_target", "report", "run", "PRIMEPAR_SEARCH_MS"]
