"""``python -m stpc plan``: plan one training step of a model on meta tensors, and print the
plan in a page (``plan.summary()``: step time split into compute / exposed / hidden
communication, per-device memory by part, one block per distinct layer with each
matmul-like op's strategy and its cheapest alternative by full effect).

``--model``: a zoo name, ``package.module:factory`` (a callable returning ``(model,
example_inputs)``, called with the ``--batch``/``--seq``/``--layers`` given), or a path to a
Hugging Face ``config.json`` (built on meta, random weights, nothing downloaded; called with
``input_ids`` and ``labels`` of ``--batch x --seq``). An unknown one is a usage error (exit
code 2) that lists the zoo. ``--layers N`` builds the model N layers deep (plan at reduced
depth). ``--brief`` prints the few header lines only; ``--quiet`` one line (mesh, modelled
step time, peak memory, plan hash). A search that takes over a second shows a progress
line on stderr (when it is a terminal): the candidate mesh shape or layout being solved,
the incumbent (best modelled step time so far), the lower bound on the optimum and the gap
between them, and the elapsed time.

Exit codes: 0 planned; 1 no plan (e.g. no plan fits the budget: the error says the smallest
budget that does) or another failure; 2 a usage error. An error is one line on stderr.

Defaults (the same for every model unless given): global batch 8, sequence
2048 (capped at the model's position table), fp32 with AdamW (16 B/param);
``--dtype bf16`` / ``fp16`` plan mixed precision (16-bit weights/activations,
fp32 master weights and Adam state: 18 B/param; V100 has no bf16 units, so
PrimePar-style V100 comparisons use fp16). The budget is the cluster's default budget
(its device memory times the usable fraction, 0.8: ``Cluster.default_budget_bytes``)
unless ``--budget-gib`` is given.

``--hints megatron|fsdp-tp|spatial`` plans a baseline instead: the best plan of its own
space (every DP x TP factorisation and axis order, ZeRO on or off; see
``stpc.planner.baselines``) under the same cost model and budget; the layout it picked
is printed and written to the JSON summary (``layout``).

``--plot FILE.png`` writes two pictures (``stpc.viz``, needs matplotlib): ``FILE-memory.png``,
the modelled per-device memory over the step (parameters, gradients, optimizer state,
activations growing through forward and released through backward, each op's transient)
and its parts at the peak; ``FILE-layers.png``, the modelled step time per distinct layer
(compute / exposed / hidden communication) beside the megatron preset's best plan on the
same devices and budget (beside stpc's own plan when ``--hints megatron``).
"""
from __future__ import annotations

import time

from stpc.cli._common import (DEFAULT_BATCH, DEFAULT_SEQ, Failure, Parser, add_flags, check_mesh_fits, meta_trace, verb,
                              write_json)
from stpc.cli._progress import SearchStatus
from stpc.cost_models import GRAD_BUCKET_BYTES, OPTIMIZER_IMPLS, get_cluster
from stpc.frontend import dump
from stpc.planner import BASELINES, PRESETS, HintUnsatisfiable, InfeasibleBudget, search
from stpc.planner.baselines import describe_layout
from stpc.planner.solver import TIME_LIMIT_S

HINTS = list(dict.fromkeys([*BASELINES, *PRESETS]))


def plan_model(model: str, mesh: str, cluster: str = "primepar-v100", batch: int | None = None,
               seq: int | None = None, dtype: str = "fp32", budget_gib: float | None = None,
               hints: str | None = None, temporal: bool = True, use_budget: bool = True,
               layers: int | None = None, progress: bool = False, recompute: str | None = None,
               time_limit_s: float = TIME_LIMIT_S, recompute_layers: int | None = None,
               optimizer_impl: str = "foreach", grad_bucket_bytes: float | None = GRAD_BUCKET_BYTES):
    """Trace ``model`` (a zoo name, ``package.module:factory`` or a Hugging Face config path:
    ``stpc.cli._common.load_model``) on meta tensors and search; returns (plan, traced graph).
    ``progress``: status lines on stderr for the trace and a search over a second.
    ``recompute_layers``: with ``recompute`` full or selective, only that many leading layers
    (``Hints.recompute_layers``). ``optimizer_impl``: the AdamW implementation the step is
    costed with, ``grad_bucket_bytes`` the data-parallel gradient buckets (``stpc.search``)."""
    t0 = time.perf_counter()
    tg, batch, seq = meta_trace(model, batch, seq, dtype, layers, progress=progress)
    t1 = time.perf_counter()
    cl = get_cluster(cluster)
    budget = None
    if use_budget:
        budget = budget_gib * 2**30 if budget_gib is not None else cl.default_budget_bytes
    with SearchStatus(f"search {model} on {mesh}", progress) as status:
        plan = search(tg, mesh, cl, budget_bytes=budget, hints=hints, temporal=temporal, dtype=dtype,
                      optimizer_layout="fp32-adam" if dtype == "fp32" else "mixed-adam", progress=status,
                      recompute=recompute, time_limit_s=time_limit_s, recompute_layers=recompute_layers,
                      optimizer_impl=optimizer_impl, grad_bucket_bytes=grad_bucket_bytes)
    t2 = time.perf_counter()
    plan.stats.update(trace_time_s=t1 - t0, analysis_time_s=tg.meta.get("analysis_s"), total_time_s=t2 - t0,
                      batch=batch, seq=seq)
    return plan, tg


def summary(plan) -> dict:
    s = plan.stats
    return {"plan_hash": plan.hash(), "model": plan.model, "mesh_shape": plan.mesh_shape,
            "cluster": plan.cluster, "modelled_step_time_s": plan.modelled_step_time_s,
            "peak_memory_bytes": plan.peak_memory_bytes, "budget_bytes": plan.budget_bytes,
            "search_time_s": s["search_time_s"], "solve_time_s": s["solve_time_s"],
            "trace_time_s": s.get("trace_time_s"), "analysis_time_s": s.get("analysis_time_s"),
            "total_time_s": s.get("total_time_s"),
            "num_nodes": s["num_nodes"], "num_groups": s["num_groups"], "num_variables": s["num_variables"],
            "strategy_counts": plan.strategy_counts(), "fallback_ops": s["fallback_ops"],
            "mesh_shapes_tried": s["mesh_shapes_tried"], "batch": s.get("batch"), "seq": s.get("seq"),
            "hints": s.get("hints"), "layout": s.get("layout"), "optimal": s.get("optimal"),
            "unresolved": s.get("unresolved", []), "grad_bucket_bytes": s.get("grad_bucket_bytes")}



@verb
def main_plan(argv: list[str]) -> int:
    p = Parser("python -m stpc plan", __doc__)
    add_flags(p, {"model": {"required": True}, "layers": {"shown": "the model's own"},
                  "mesh": {"required": True}, "cluster": {"default": "primepar-v100"},
                  "batch": {"shown": DEFAULT_BATCH},
                  "seq": {"shown": f"{DEFAULT_SEQ}, capped at the model's position table"},
                  "dtype": {"default": "fp32"}, "budget-gib": {"shown": "80% of the cluster's device memory"},
                  "json": {"shown": "none", "note": "the summary, and the plan itself beside it (NAME.plan.json)"}})
    p.add_argument("--no-budget", action="store_true", help="plan without a memory limit")
    p.add_argument("--hints", default=None, choices=HINTS, help="plan a preset instead: megatron, fsdp-tp, spatial "
                   "(baselines, each the best of its own layout space), dp")
    p.add_argument("--no-temporal", action="store_true", help="spatial strategies only (Alpa-like)")
    p.add_argument("--recompute", default="auto", choices=("auto", "none", "selective", "full"),
                   help="recompute the layers' activations in backward: auto (where the budget binds), none, "
                        "selective (all but their matmuls' and fused attentions' outputs), full "
                        "(default: %(default)s)")
    p.add_argument("--recompute-layers", type=int, default=None, metavar="N",
                   help="with --recompute selective or full: only the first N layers (Megatron's "
                        "--recompute-num-layers; default: every layer)")
    p.add_argument("--solver-time-limit", type=float, default=TIME_LIMIT_S, metavar="SECONDS",
                   help="CP-SAT's wall-clock limit on each mesh shape the budget binds on; one that runs out "
                        "is reported unresolved (default: %(default)s)")
    p.add_argument("--optimizer-impl", default="foreach", choices=OPTIMIZER_IMPLS,
                   help="the AdamW implementation the trainer steps with, whose step time and scratch every plan is "
                        "charged: foreach (AdamW(foreach=True)), fused (AdamW(fused=True), TorchTitan's default), "
                        "single (the per-tensor loop) (default: %(default)s)")
    p.add_argument("--bucket-mb", default=f"{GRAD_BUCKET_BYTES / 2**20:g}", metavar="MB",
                   help="the data-parallel gradient buckets the program will sum in (stpc.compile's bucket_mb), or "
                        "none: each gradient summed where backward makes it (default: %(default)s)")
    p.add_argument("--dump", default=None, metavar="FILE", help="write the per-node plan table here (+ .dot)")
    p.add_argument("--brief", action="store_true", help="print the header lines only, not the plan's summary")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write FILE-memory.png (memory over the step) "
                   "and FILE-layers.png (per-layer step time against the megatron preset); needs matplotlib")
    a = p.parse_args(argv)
    if a.no_budget and a.budget_gib is not None:
        p.error("--budget-gib and --no-budget contradict each other. Fix: give one of them")
    if not a.solver_time_limit > 0:
        p.error(f"--solver-time-limit {a.solver_time_limit:g}: CP-SAT needs some time. Fix: give a number of "
                "seconds above 0")
    if a.recompute_layers is not None and (a.recompute not in ("selective", "full") or a.recompute_layers < 1):
        p.error(f"--recompute-layers {a.recompute_layers}: a count of layers >= 1, with --recompute selective or "
                f"full (it is {a.recompute}). Fix: add --recompute full, or leave --recompute-layers out")
    buckets = _bucket_bytes(p, a.bucket_mb)
    check_mesh_fits(a.mesh, get_cluster(a.cluster))
    say = (lambda *x, **k: None) if a.quiet else print
    viz = None
    if a.plot:
        try:
            from stpc import viz  # lazy: matplotlib (~0.5 s, a test extra) is only needed for --plot
        except ImportError as e:
            raise Failure(f"--plot needs matplotlib ({e})", "pip install matplotlib") from None
    plan, tg = plan_model(a.model, a.mesh, a.cluster, a.batch, a.seq, a.dtype, a.budget_gib, a.hints,
                          not a.no_temporal, use_budget=not a.no_budget, layers=a.layers, progress=not a.quiet,
                          recompute=None if a.recompute == "auto" else a.recompute,
                          time_limit_s=a.solver_time_limit, recompute_layers=a.recompute_layers,
                          optimizer_impl=a.optimizer_impl, grad_bucket_bytes=buckets)
    s = summary(plan)
    if a.quiet:
        print(f"mesh {'x'.join(map(str, plan.mesh_shape))}  modelled step {plan.modelled_step_time_s * 1e3:.2f} ms  "
              f"peak {plan.peak_memory_bytes / 2**30:.2f} GiB/device  plan {s['plan_hash'][:12]}")
    say(f"model {a.model}  mesh {'x'.join(map(str, plan.mesh_shape))}  cluster {plan.cluster}  "
        f"batch {s['batch']} seq {s['seq']} {a.dtype}")
    say(f"modelled step {plan.modelled_step_time_s * 1e3:.2f} ms  peak {plan.peak_memory_bytes / 2**30:.2f} "
        f"GiB/device  search {s['search_time_s']:.3f} s  total {s['total_time_s']:.2f} s  "
        f"nodes {s['num_nodes']}  variables {s['num_variables']}")
    say(f"layout: {describe_layout(s['layout'])}" + (f"  (hints {s['hints']})" if s["hints"] else ""))
    if s["optimal"] is False:
        say("not proven optimal: " + (f"CP-SAT ran out of time on {', '.join(s['unresolved'])} (a better plan may "
                                      "lie there; rerun on an idle machine or with a longer --solver-time-limit)" if s["unresolved"] else
                                      "the chosen layout's CP-SAT solve stopped at its time limit with a solution"))
    if s["fallback_ops"]:
        say("replicated (no sharding rule): " + ", ".join(f"{k} x{v}" for k, v in s["fallback_ops"].items()))
    if a.brief or a.quiet:
        say("strategies: " + ", ".join(f"{k} {v}" for k, v in s["strategy_counts"].items()))
    else:
        t_sum = time.perf_counter()
        print()
        print(plan.summary(), end="")
        print(f"(summary {time.perf_counter() - t_sum:.2f} s: its re-solves; plan.explain(node) ranks every "
              "alternative of a node)")
    if a.json:
        if "breakdown" in plan.stats:  # (the summary's, when it was printed)
            s["summary_time_s"] = plan.stats.get("summary_time_s")
            s["breakdown"] = plan.stats.get("breakdown")
        write_json(a.json, s, sort_keys=True)
        plan.save(a.json.removesuffix(".json") + ".plan.json")
        say(f"wrote {a.json}")
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(plan.table())
        dump(tg, a.dump.removesuffix(".txt") + ".graph.txt", plan=plan)
        say(f"wrote {a.dump}")
    if viz is not None:
        _plot(viz, a, plan, tg, say)
    return 0


def _bucket_bytes(p: Parser, text: str) -> float | None:
    """``--bucket-mb``'s bytes (None for ``none``), or the parser's error naming the fix."""
    if text.strip().lower() == "none":
        return None
    try:
        mb = float(text)
    except ValueError:
        mb = float("nan")
    if not mb > 0 or mb == float("inf"):
        p.error(f"--bucket-mb {text}: a positive number of MiB, or none. Fix: e.g. --bucket-mb 25 (DDP's "
                f"default)")
    return mb * 2**20


def _plot(viz, a, plan, tg, say=print) -> None:
    """``--plot``: the baseline (the megatron preset; stpc's own plan if this one is megatron's)
    searched on the same graph, devices and budget, then ``stpc.viz.plot_plan``."""
    other = None if a.hints == "megatron" else "megatron"
    try:
        base = search(tg, a.mesh, get_cluster(a.cluster), budget_bytes=plan.budget_bytes, hints=other,
                      temporal=not a.no_temporal, dtype=a.dtype,
                      optimizer_layout="fp32-adam" if a.dtype == "fp32" else "mixed-adam",
                      optimizer_impl=a.optimizer_impl,
                      grad_bucket_bytes=plan.stats.get("grad_bucket_bytes", GRAD_BUCKET_BYTES))
    except (InfeasibleBudget, HintUnsatisfiable, ValueError) as e:
        say(f"(no {other or 'stpc'} baseline in the picture: {str(e).splitlines()[0]})")
        base = None
    for path in viz.plot_plan(plan, a.plot, base, tg):
        say(f"wrote {path}")
