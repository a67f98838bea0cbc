"""The README's main job: a small GPT planned, compiled and trained on 4 CPU ranks, then a
large model's modelled comparison with the baselines.

1. plan: trace the small model on meta tensors and plan it for the ranks on this world's
   default cluster. If the solver's own plan uses no spatial-temporal family (AG/RS
   rings, P2x2) the demo says so and forces AG/RS rings with a hint, to show them;
   the plan's summary is printed.
2. train: spawn the gloo ranks; each compiles the model under that plan with
   ``stpc.compile`` and trains --steps AdamW steps. Every step the loss and every
   gradient are checked against a single-device copy holding the distributed model's
   current parameters, and the loss against the single-device model trained alone
   (fp32, |a - b| <= 1e-6 + 1e-4 |b|; NaN or inf fails): MATCH or MISMATCH, with the
   worst errors.
3. compare (modelled, not run): a large zoo model on the primepar-v100 cluster (fp16
   mixed precision, the cluster's default budget: 80% of 32 GiB): stpc's own plan against
   the best Megatron layout, FSDP+TP and spatial-only, each the best of its own space
   under the same cost model. The model is traced once on meta and every search reuses
   the graph.

The plan, its summary and the graph after each pass land in --out; --json writes the
outcome (plan hash, losses, worst errors, MATCH, the comparison's rows). --quiet prints
only the [check] verdict and the comparison's last line.
Exit code: 0 on MATCH, 1 on MISMATCH or a failure, 2 on a usage error.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import time

import torch

from stpc.cli._common import Failure, Parser, add_flags, check_mesh_fits, meta_trace, verb, write_json
from stpc.cli._progress import SearchStatus, Status, bar
from stpc.compile import compile as stpc_compile
from stpc.compile import trace
from stpc.cost_models import get_cluster, world_cluster
from stpc.frontend import dump, models
from stpc.planner import HintUnsatisfiable, Hints, InfeasibleBudget, Plan, search
from stpc.planner.baselines import describe_layout
from stpc.planner.hints import ROW
from stpc.runtime.launch import spawn

BATCH, SEQ = 8, 32                   # the small model's global batch (default)
LR, WEIGHT_DECAY = 1e-2, 0.1         # AdamW, as the 20-step parity tests train
TEMPORAL = ("ag_ring", "rs_ring", "p2x2")
RINGS = Hints(force=[(r"(q_proj|k_proj|v_proj|fc1|gate_proj|up_proj)$", lambda s: s.kind == "ag_ring"),
                     (ROW, lambda s: s.kind == "rs_ring")], name="ag/rs rings")
BASELINES = (("megatron", "Megatron (best)"), ("fsdp-tp", "FSDP+TP (best)"), ("spatial", "spatial only"))


@verb
def main_demo(argv: list[str]) -> int:
    a = _args(argv)
    say = (lambda *x, **k: None) if a.quiet else print
    os.makedirs(a.out, exist_ok=True)
    plan, tg = _plan(a, say)
    summary = plan.summary()
    say(summary, end="")
    _write(plan, tg, summary, a.out, say)
    result = _train(a, plan, say)
    if a.compare != "none":
        result["compare"] = _compare(a.compare, a.compare_devices, a.compare_batch, a.compare_seq, say, not a.quiet)
    if a.json:
        write_json(a.json, {"model": a.model, "ranks": a.ranks, "mesh": list(plan.mesh_shape), "batch": a.batch,
                            "seq": a.seq, "steps": a.steps, "cluster": plan.cluster,
                            "modelled_step_time_s": plan.modelled_step_time_s,
                            "strategy_counts": plan.strategy_counts(), **result})
        say(f"wrote {a.json}")
    if not result["match"]:
        raise Failure("the distributed run did not match the single-device model (the [check] lines above say where)",
                      f"report it with {a.out}/plan.json and the graph after each pass in {a.out}/passes/")
    return 0


def _args(argv):
    p = Parser("python -m stpc demo", __doc__)
    add_flags(p, {"model": {"default": "gpt-tiny", "zoo": True}, "layers": {"shown": "the model's own"},
                  "batch": {"default": BATCH}, "seq": {"default": SEQ, "note": "at most the model's position table"},
                  "ranks": {"default": 4, "note": "gloo, on this machine"},
                  "mesh": {"shown": "--ranks", "note": "its devices must be --ranks"},
                  "cluster": {"shown": "this machine's: its calibration profile if there is one, else cpu-local"},
                  "budget-gib": {"shown": "none; gpt-tiny's plan needs about 0.0013"},
                  "steps": {"default": 20, "note": "each one checked"},
                  "timeout": {"default": 600.0, "shown": "600"},
                  "json": {"shown": "none", "note": "the outcome"}})
    arg = p.add_argument
    arg("--out", default="out/demo", metavar="DIR", help="folder for the plan and the graph dumps (default out/demo)")
    arg("--compare", default="llama2-7b", metavar="NAME",
        help="zoo model of the modelled comparison (default llama2-7b; 'none' skips it)")
    arg("--compare-devices", type=int, default=32, metavar="N",
        help="its device count (default 32: the preset's 8 nodes x 4 V100)")
    arg("--compare-batch", type=int, default=2, metavar="N", help="its global batch (default 2)")
    arg("--compare-seq", type=int, default=4096, metavar="N", help="its sequence length (default 4096)")
    a = p.parse_args(argv)
    if a.compare not in {*models.CONFIGS, "none"}:
        p.error(f"--compare: unknown model {a.compare!r}; known: " + ", ".join(sorted(models.CONFIGS))
                + ". Fix: give one of those, or none")
    if min(a.compare_devices, a.compare_batch, a.compare_seq) < 1:
        p.error("the --compare-* numbers must be at least 1")
    cfg = models.get_config(a.model)
    if a.seq > cfg.max_seq:
        p.error(f"--seq {a.seq} exceeds {a.model}'s position table ({cfg.max_seq}). Fix: --seq {cfg.max_seq} or less")
    a.mesh = a.mesh or str(a.ranks)
    size = math.prod(int(x) for x in a.mesh.lower().split("x"))
    if size != a.ranks:
        p.error(f"--mesh {a.mesh} has {size} devices; --ranks is {a.ranks}. Fix: make them agree")
    return a


def _build(a, **kwargs):
    """The demo's model: the zoo's ``a.model``, ``a.layers`` deep if given."""
    return models.build(a.model, **({"n_layers": a.layers} if a.layers else {}), **kwargs)


def _plan(a, say=print) -> tuple[Plan, object]:
    """The solver's own plan on this world's cluster (or --cluster); forced AG/RS rings if it
    has no spatial-temporal family."""
    cluster = get_cluster(a.cluster) if a.cluster else world_cluster(a.ranks, "cpu")
    check_mesh_fits(a.mesh, cluster)
    with Status(f"trace {a.model}", not a.quiet):
        with torch.device("meta"):
            meta_model = _build(a)
        tg = trace(meta_model, models.example_inputs(meta_model.cfg, a.batch, a.seq), name=a.model)
    budget = a.budget_gib * 2**30 if a.budget_gib is not None else None
    say(f"[trace] {a.model}: {len(tg.graph.nodes)} nodes, {tg.num_params():,} parameters, batch {a.batch} x "
        f"seq {a.seq}; planning for {a.ranks} ranks on {cluster.name}")
    with SearchStatus(f"search {a.model} on {a.mesh}", not a.quiet) as status:
        plan = search(tg, a.mesh, cluster, budget_bytes=budget, progress=status)
    own = plan.strategy_counts()
    say(f"[plan]  the solver's own plan: mesh {_shape(plan)}, modelled step {plan.modelled_step_time_s * 1e3:.3f} "
          f"ms, families {_families(own)}")
    if not any(k in TEMPORAL for k in own):
        try:
            with SearchStatus(f"search {a.model} on {a.mesh}, rings forced", not a.quiet) as status:
                forced = search(tg, a.mesh, cluster, budget_bytes=budget, hints=RINGS, progress=status)
        except HintUnsatisfiable as e:
            say(f"[plan]  the solver's own plan uses no ring here, and mesh {a.mesh} cannot run them: {e}\n")
            return plan, tg
        say(f"[plan]  the solver's own plan uses no ring here; forcing AG/RS rings to show them: mesh "
              f"{_shape(forced)}, modelled step {forced.modelled_step_time_s * 1e3:.3f} ms "
              f"({forced.modelled_step_time_s / plan.modelled_step_time_s:.2f}x the solver's own), families "
              f"{_families(forced.strategy_counts())}")
        plan = forced
    say()
    return plan, tg


def _write(plan, tg, summary, out, say=print):
    plan.save(os.path.join(out, "plan.json"))
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary)
    with open(os.path.join(out, "plan.txt"), "w") as f:
        f.write(plan.table())
    dump(tg, os.path.join(out, "traced.txt"), plan=plan)
    say(f"[dump]  {out}/: plan.json, summary.txt, plan.txt (every node), traced.txt (+ .dot); the graph "
          f"after each pass goes to {out}/passes/")


def _train(a, plan, say=print) -> dict:
    say(f"[train] spawning {a.ranks} gloo ranks: each compiles the model under this plan, then trains",
        flush=True)  # flushed: the ranks write to the same stdout
    t0 = time.perf_counter()
    res = spawn(_rank, a.ranks, a.model, a.steps, plan.to_json(), a.out, a.batch, a.seq, a.layers, not a.quiet,
                timeout_s=a.timeout)
    r = res[0]
    agreed = len({x["plan_hash"] for x in res}) == 1
    say(f"[train] {a.ranks} gloo ranks compiled plan {r['plan_hash'][:12]} ("
        f"{'every rank agreed' if agreed else 'the ranks DISAGREED'}) in {r['compile_s']:.1f} s, then "
        f"{a.steps} AdamW steps in {r['train_s']:.1f} s (wall {time.perf_counter() - t0:.1f} s)")
    (l0, s0), (l1, s1) = r["losses"][0], r["losses"][-1]
    say(f"[train] loss {l0:.6f} -> {l1:.6f} distributed, {s0:.6f} -> {s1:.6f} single-device trained alone")
    say(f"[check] every step: the loss and all {r['n_grads']} gradients against a single-device copy holding the "
        f"distributed model's parameters, and the loss against the single-device model trained alone")
    say(f"[check] worst errors, in units of the fp32 tolerance |a - b| <= 1e-6 + 1e-4 |b| (1 = at it; NaN/inf "
        f"fails): loss {r['loss']:.3g}, gradients {r['grad']:.3g} ({r['grad_name']}), loss against the run "
        f"alone {r['ref_loss']:.3g}")
    ok = agreed and max(r["loss"], r["grad"], r["ref_loss"]) <= 1
    print(f"[check] {'MATCH' if ok else 'MISMATCH'}")
    return {"match": ok, "ranks_agreed": agreed, "plan_hash": r["plan_hash"], "compile_s": r["compile_s"],
            "train_s": r["train_s"], "losses": r["losses"],
            "worst": {k: (None if isinstance(r[k], float) and not math.isfinite(r[k]) else r[k])
                      for k in ("loss", "grad", "grad_name", "ref_loss")}}


def _rank(rank, world, name, steps, plan_json, out, batch=BATCH, seq=SEQ, layers=None, progress=True):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # full_tensor() chatter
    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    model = models.build(name, **({"n_layers": layers} if layers else {}))  # the same weights on every rank
    check = _Check(model) if rank == 0 else None  # copies, before compile takes the model over
    g = torch.Generator().manual_seed(1234)
    vocab = models.get_config(name).vocab
    tokens = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]
    batches = [(x, (x + 1) % vocab) for x in tokens]  # a rule to learn: the next token is this one + 1
    t0 = time.perf_counter()
    dm = stpc_compile(model, tuple(plan.mesh_shape), batches[0], plan=plan)
    t1 = time.perf_counter()
    opt = torch.optim.AdamW(dm.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps_bar = bar(steps, "[train]", progress and check is not None)  # rank 0's, on stderr
    for step, batch in enumerate(batches):
        # every rank takes part in the gathers (full_tensor is a collective); rank 0 checks
        params = {k: p.detach().full_tensor().clone() for k, p in dm.named_parameters()}
        opt.zero_grad()
        loss = dm(*batch)
        loss.backward()
        grads = {k: p.grad.full_tensor().clone() for k, p in dm.named_parameters() if p.grad is not None}
        if check:
            check.step(step, batch, loss.detach(), params, grads)
        steps_bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        steps_bar.update()
        opt.step()
    steps_bar.close()
    if not check:
        return {"plan_hash": dm.stpc.plan.hash()}
    dm.stpc.dump_passes(os.path.join(out, "passes"))
    return {**check.worst, "plan_hash": dm.stpc.plan.hash(), "compile_s": t1 - t0,
            "train_s": time.perf_counter() - t1, "n_grads": len(grads)}


class _Check:
    """Rank 0's check of each step: the distributed loss and gradients against a probe (the
    single-device model holding the distributed model's current parameters, so no drift
    between the two programs reaches it), and the loss against the model trained alone.
    Errors in units of the tolerance (``_err``); the worst of each is kept."""

    def __init__(self, model):
        self.probe, self.alone = copy.deepcopy(model), copy.deepcopy(model)
        self.probe_params = dict(self.probe.named_parameters())
        self.opt = torch.optim.AdamW(self.alone.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        self.worst = {"loss": 0.0, "grad": 0.0, "grad_name": "none differ", "ref_loss": 0.0, "losses": []}

    def step(self, step, batch, loss, params, grads):
        with torch.no_grad():
            for k, v in params.items():
                self.probe_params[k].copy_(v)
        self.probe.zero_grad()
        here = self.probe(*batch)
        here.backward()
        self.opt.zero_grad()
        alone = self.alone(*batch)
        alone.backward()
        self.opt.step()
        w = self.worst
        w["losses"].append((loss.item(), alone.item()))
        w["loss"] = max(w["loss"], _err(loss, here.detach()))
        w["ref_loss"] = max(w["ref_loss"], _err(loss, alone.detach()))
        for k, p in self.probe_params.items():
            e = _err(grads[k], p.grad) if k in grads and p.grad is not None else math.inf
            if e > w["grad"] or math.isnan(e):
                w["grad"], w["grad_name"] = e, f"{k} at step {step}"


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (1e-6 + 1e-4 |b|): <= 1 is a match; NaN, inf or a shape mismatch is inf."""
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    return float(((a - b).abs() / (1e-6 + 1e-4 * b.abs())).max())


def _compare(name, devices, batch, seq, say=print, progress=True) -> list[dict]:
    """stpc's own plan against the baselines for ``name``, modelled: one trace, four searches.
    Returns one record per row (for --json)."""
    t0 = time.perf_counter()
    tg, batch, seq = meta_trace(name, batch, seq, "fp16", progress=progress)
    cl = get_cluster("primepar-v100")
    budget = cl.default_budget_bytes   # (80% of the device's memory: Cluster.usable_memory_fraction)
    say(f"\n[model] {name} on {devices} x {cl.device.name} ({cl.name}), fp16 mixed precision, AdamW, batch "
        f"{batch} x seq {seq}, budget {budget / 2**30:.1f} GiB/device: MODELLED by stpc's cost model, not run")
    rows = []
    for hints, label in (("", "stpc"), *BASELINES):
        try:
            with SearchStatus(f"search {name} on {devices}: {label}", progress) as status:
                p = search(tg, devices, cl, budget_bytes=budget, hints=hints or None, dtype="fp16",
                           optimizer_layout="mixed-adam", progress=status)
        except InfeasibleBudget as e:
            rows.append((label, None, f"does not fit: needs {e.min_budget / 2**30:.1f} GiB/device"))
            continue
        layout = describe_layout(p.stats.get("layout")) if hints else f"mesh {_shape(p)}"
        rows.append((label, p, f"{layout}; {_families(p.strategy_counts())}"))
    records = [{"plan": label, "layout": what, "modelled_step_time_s": p.modelled_step_time_s if p else None,
                "peak_memory_bytes": p.peak_memory_bytes if p else None} for label, p, what in rows]
    if rows[0][1] is None:
        print(f"[model] stpc {rows[0][2]}: no comparison on {devices} devices (give more: --compare-devices)")
        return records
    stpc_time = rows[0][1].modelled_step_time_s
    say(f"  {'plan':16} {'step (modelled)':>16} {'peak/device':>12} {'stpc speedup':>13}  layout; families")
    for label, p, what in rows:
        if p is None:
            say(f"  {label:16} {'-':>16} {'-':>12} {'-':>13}  {what}")
            continue
        say(f"  {label:16} {p.modelled_step_time_s * 1e3:13.1f} ms {p.peak_memory_bytes / 2**30:8.2f} GiB "
            f"{p.modelled_step_time_s / stpc_time:12.2f}x  {what}")
    fits = [(p.modelled_step_time_s, label) for label, p, _ in rows[1:] if p is not None]
    if fits:
        best, label = min(fits)
        print(f"[model] stpc against the best baseline that fits ({label}): {best / stpc_time:.2f}x, modelled "
              f"({time.perf_counter() - t0:.1f} s: one trace on meta, {len(rows)} searches)")
    return records


def _shape(plan) -> str:
    return "x".join(map(str, plan.mesh_shape))


def _families(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())
