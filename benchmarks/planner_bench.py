"""Planner search time on the PrimePar models and device counts, measured on this machine.

    .venv/bin/python benchmarks/planner_bench.py [--models ...] [--sizes 4 8 16 32] [--baselines ...] [--repeat 5]

For each model: trace once on meta tensors (timed; it includes the mesh-independent
graph analysis, ``stpc.planner.analyse``, also shown on its own), then for each device
count search every logical mesh shape (``stpc.planner.search``) on the ``primepar-v100``
cluster (8 nodes x 4 V100, NVLink / InfiniBand), fp16 mixed precision, global
batch 8 x sequence 2048, budget 32 GB per device (--no-budget: none). "search" is strategy
enumeration + costing + solving over all mesh shapes + reading the plan back, after
tracing: the median of --repeat runs, and the first (cold) run on its own; "total" is
the trace plus the first run (what one ``stpc plan`` call pays). A cell whose budget
is infeasible reports the time to prove it. With --baselines megatron fsdp-tp spatial
it also plans each baseline (the best plan of its own layout space,
``stpc.planner.baselines``) on the same cost model and budget, with the layout it chose,
and the modelled speedup against the best baseline that fits (``--megatron``: Megatron
alone). Prints markdown.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from stpc import models, trace
from stpc.cost_models import get_cluster
from stpc.planner import search
from stpc.planner.baselines import BASELINES, describe_layout
from stpc.planner.solver import InfeasibleBudget

PRIMEPAR_MS = {  # published search time (ms, one Xeon thread), REFERENCES.md
    "opt": {4: 85, 8: 87, 16: 171, 32: 5357},
    "llama2": {4: 87, 8: 89, 16: 186, 32: 6070},
    "bloom": {4: 85, 8: 80, 16: 166, 32: 4153},
}


def family(name):
    return next(k for k in PRIMEPAR_MS if name.startswith(k))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["llama2-7b", "llama2-70b", "opt-6.7b", "opt-175b",
                                                    "bloom-7b1", "bloom-176b"])
    p.add_argument("--sizes", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--baselines", nargs="*", default=[], choices=list(BASELINES),
                   help="baseline presets to plan beside stpc's own search")
    p.add_argument("--megatron", action="store_true", help="the same as --baselines megatron")
    p.add_argument("--no-budget", action="store_true", help="plan without a memory limit")
    p.add_argument("--repeat", type=int, default=5, help="searches per cell (median reported)")
    p.add_argument("--per-shape", action="store_true",
                   help="after the table, each planned cell's mesh shapes: build and solve ms")
    a = p.parse_args(argv)
    if a.megatron and "megatron" not in a.baselines:
        a.baselines.append("megatron")
    cl = get_cluster("primepar-v100")
    budget = None if a.no_budget else cl.device.mem_bytes
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}, budget {'none' if budget is None else f'{budget / 1e9:.0f} GB'}\n")
    extra = "".join(f" {b} modelled s | {b} layout | {b} search s |" for b in a.baselines)
    extra += " speedup vs best baseline (modelled) |" if a.baselines else ""
    print(f"| model | devices | trace s | analysis ms | search s (median of {a.repeat}) | first run s | total s "
          "| PrimePar search s | median <= PrimePar | mesh | modelled step s | peak GiB | families |" + extra)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|---|" * len(a.baselines)
          + ("---|" if a.baselines else ""))
    blank = " - | - | - |" * len(a.baselines) + (" - |" if a.baselines else "")
    shapes = []  # (model, devices, mesh_shapes_tried) of every planned cell
    for name in a.models:
        cfg = models.get_config(name)
        t0 = time.perf_counter()
        with torch.device("meta"):
            m = models.build(cfg).to(torch.float16)
        tg = trace(m, models.example_inputs(cfg, a.batch, min(a.seq, cfg.max_seq)), name=name)
        t_trace = time.perf_counter() - t0
        t_analysis = tg.meta["analysis_s"]
        for n in a.sizes:
            times = []
            for _ in range(a.repeat):
                t1 = time.perf_counter()
                try:
                    plan = search(tg, n, cl, budget_bytes=budget, dtype="fp16", optimizer_layout="mixed-adam")
                    err = None
                except InfeasibleBudget as e:
                    plan, err = None, e
                times.append(time.perf_counter() - t1)
            t_search, t_first = statistics.median(times), times[0]
            ref = PRIMEPAR_MS[family(name)][n] / 1e3 if n in PRIMEPAR_MS[family(name)] else float("nan")
            head = (f"| {name} | {n} | {t_trace:.2f} | {1e3 * t_analysis:.1f} | {t_search:.3f} | {t_first:.3f} "
                    f"| {t_trace + t_first:.2f} | {ref:.3f} | {'yes' if t_search <= ref else 'no'} |")
            if plan is None:
                row = head + f" infeasible | - | needs {err.min_budget / 2**30:.1f} | - |"
                print(row + blank, flush=True)
                continue
            shapes.append((name, n, plan.stats["mesh_shapes_tried"]))
            fams = ", ".join(f"{k} {v}" for k, v in plan.strategy_counts().items())
            row = (head + f" {'x'.join(map(str, plan.mesh_shape))} | {plan.modelled_step_time_s:.3f} | "
                   f"{plan.peak_memory_bytes / 2**30:.1f} | {fams} |")
            fastest = None
            for b in a.baselines:
                t1 = time.perf_counter()
                try:
                    bp = search(tg, n, cl, budget_bytes=budget, hints=b, dtype="fp16", optimizer_layout="mixed-adam")
                except InfeasibleBudget:
                    row += f" infeasible | - | {time.perf_counter() - t1:.3f} |"
                    continue
                row += (f" {bp.modelled_step_time_s:.3f} | {describe_layout(bp.stats['layout'])} "
                        f"| {time.perf_counter() - t1:.3f} |")
                fastest = min(fastest or bp.modelled_step_time_s, bp.modelled_step_time_s)
            if a.baselines:
                row += f" {fastest / plan.modelled_step_time_s:.2f}x |" if fastest else " - |"
            print(row, flush=True)
    if a.per_shape:
        print("\nper mesh shape (ms): build = strategies + costs + edges; solve = memory check + "
              "elimination (+ CP-SAT where the budget binds); pruned = its bound could not win\n")
        print("| model | devices | mesh | build ms | solve ms | outcome |")
        print("|---|---|---|---|---|---|")
        for name, n, tried in shapes:
            for t in tried:
                outcome = "pruned" if t.get("pruned") else t.get("method", "-")
                print(f"| {name} | {n} | {'x'.join(map(str, t['mesh']))} | {1e3 * t.get('build_time_s', 0):.1f} "
                      f"| {1e3 * t['solve_time_s']:.1f} | {outcome} |")


if __name__ == "__main__":
    main()
