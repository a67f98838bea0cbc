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
   mixed precision, 32 GB/device): stpc's own plan against the best Megatron layout,
   FSDP+TP and spatial-only, each the best of its own space under the same cost
   model. The model is traced once on meta and every search reuses the graph.

The plan, its summary and the graph after each pass land in --out.
Exit code: 0 on MATCH, 1 on MISMATCH or a failure, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys
import time

import torch

from stpc.cli._common import meta_trace
from stpc.compile import compile as stpc_compile
from stpc.compile import trace
from stpc.cost_models import get_cluster, world_cluster
from stpc.frontend import dump, models
from stpc.planner import HintUnsatisfiable, Hints, InfeasibleBudget, Plan, search
from stpc.planner.baselines import describe_layout
from stpc.planner.hints import ROW
from stpc.runtime.launch import SpawnError, SpawnTimeout, spawn

try:
    from tqdm import tqdm  # installed with transformers (the test extras); the demo runs without it
except ImportError:
    tqdm = None

BATCH, SEQ = 8, 32                   # the small model's global batch
LR, WEIGHT_DECAY = 1e-2, 0.1         # AdamW, as the 20-step parity tests train
TEMPORAL = ("ag_ring", "rs_ring", "p2x2")
RINGS = Hints(force=[(r"(q_proj|k_proj|v_proj|fc1|gate_proj|up_proj)$", lambda s: s.kind == "ag_ring"),
                     (ROW, lambda s: s.kind == "rs_ring")], name="ag/rs rings")
BASELINES = (("megatron", "Megatron (best)"), ("fsdp-tp", "FSDP+TP (best)"), ("spatial", "spatial only"))


def main_demo(argv: list[str]) -> int:
    a = _args(argv)
    os.makedirs(a.out, exist_ok=True)
    try:
        plan, tg = _plan(a)
        summary = plan.summary()
        print(summary, end="")
        _write(plan, tg, summary, a.out)
        ok = _train(a, plan)
        if a.compare != "none":
            _compare(a.compare, a.compare_devices, a.compare_batch, a.compare_seq)
    except (SpawnError, SpawnTimeout, InfeasibleBudget, HintUnsatisfiable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if ok else 1


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m stpc demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = p.add_argument
    arg("--model", default="gpt-tiny", metavar="NAME",
        help="the zoo model to train (default gpt-tiny; known: " + ", ".join(sorted(models.CONFIGS)) + ")")
    arg("--ranks", type=int, default=4, metavar="N", help="gloo processes to spawn (default 4)")
    arg("--mesh", default=None, metavar="SHAPE",
        help="N (the planner picks the shape) or a shape like 2x2 (default: the number of ranks)")
    arg("--steps", type=int, default=20, metavar="N", help="AdamW steps, each checked (default 20)")
    arg("--budget-gib", type=float, default=None, metavar="GIB",
        help="per-device memory budget of the small model's plan (default: none; gpt-tiny's needs about 0.0013)")
    arg("--out", default="out/demo", metavar="DIR", help="folder for the plan and the graph dumps (default out/demo)")
    arg("--compare", default="llama2-7b", metavar="NAME",
        help="zoo model of the modelled comparison (default llama2-7b; 'none' skips it)")
    arg("--compare-devices", type=int, default=32, metavar="N",
        help="its device count (default 32: the preset's 8 nodes x 4 V100)")
    arg("--compare-batch", type=int, default=2, metavar="N", help="its global batch (default 2)")
    arg("--compare-seq", type=int, default=4096, metavar="N", help="its sequence length (default 4096)")
    a = p.parse_args(argv)
    for name, known in ((a.model, models.CONFIGS), (a.compare, {*models.CONFIGS, "none"})):
        if name not in known:
            p.error(f"unknown model {name!r}; known: " + ", ".join(sorted(models.CONFIGS)))
    if min(a.ranks, a.steps, a.compare_devices, a.compare_batch, a.compare_seq) < 1:
        p.error("--ranks, --steps and the --compare-* numbers must be at least 1")
    if a.budget_gib is not None and a.budget_gib <= 0:
        p.error(f"--budget-gib {a.budget_gib}: give a positive number of GiB, or leave it out for no budget")
    a.mesh = a.mesh or str(a.ranks)
    try:
        size = math.prod(int(x) for x in a.mesh.lower().split("x"))
    except ValueError:
        p.error(f"--mesh {a.mesh!r}: give N or a shape like 2x2")
    if size != a.ranks:
        p.error(f"--mesh {a.mesh} has {size} devices; --ranks is {a.ranks}")
    return a


def _plan(a) -> tuple[Plan, object]:
    """The solver's own plan on this world's cluster; forced AG/RS rings if it has no
    spatial-temporal family."""
    with torch.device("meta"):
        meta_model = models.build(a.model)
    tg = trace(meta_model, models.example_inputs(a.model, BATCH, SEQ), name=a.model)
    cluster = world_cluster(a.ranks, "cpu")
    budget = a.budget_gib * 2**30 if a.budget_gib is not None else None
    print(f"[trace] {a.model}: {len(tg.graph.nodes)} nodes, {tg.num_params():,} parameters, batch {BATCH} x "
          f"seq {SEQ}; planning for {a.ranks} ranks on {cluster.name}")
    plan = search(tg, a.mesh, cluster, budget_bytes=budget)
    own = plan.strategy_counts()
    print(f"[plan]  the solver's own plan: mesh {_shape(plan)}, modelled step {plan.modelled_step_time_s * 1e3:.3f} "
          f"ms, families {_families(own)}")
    if not any(k in TEMPORAL for k in own):
        try:
            forced = search(tg, a.mesh, cluster, budget_bytes=budget, hints=RINGS)
        except HintUnsatisfiable as e:
            print(f"[plan]  the solver's own plan uses no ring here, and mesh {a.mesh} cannot run them: {e}\n")
            return plan, tg
        print(f"[plan]  the solver's own plan uses no ring here; forcing AG/RS rings to show them: mesh "
              f"{_shape(forced)}, modelled step {forced.modelled_step_time_s * 1e3:.3f} ms "
              f"({forced.modelled_step_time_s / plan.modelled_step_time_s:.2f}x the solver's own), families "
              f"{_families(forced.strategy_counts())}")
        plan = forced
    print()
    return plan, tg


def _write(plan, tg, summary, out):
    plan.save(os.path.join(out, "plan.json"))
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary)
    with open(os.path.join(out, "plan.txt"), "w") as f:
        f.write(plan.table())
    dump(tg, os.path.join(out, "traced.txt"), plan=plan)
    print(f"[dump]  {out}/: plan.json, summary.txt, plan.txt (every node), traced.txt (+ .dot); the graph "
          f"after each pass goes to {out}/passes/")


def _train(a, plan) -> bool:
    print(f"[train] spawning {a.ranks} gloo ranks: each compiles the model under this plan, then trains",
          flush=True)  # flushed: the ranks write to the same stdout
    t0 = time.perf_counter()
    res = spawn(_rank, a.ranks, a.model, a.steps, plan.to_json(), a.out, timeout_s=600)
    r = res[0]
    agreed = len({x["plan_hash"] for x in res}) == 1
    print(f"[train] {a.ranks} gloo ranks compiled plan {r['plan_hash'][:12]} ("
          f"{'every rank agreed' if agreed else 'the ranks DISAGREED'}) in {r['compile_s']:.1f} s, then "
          f"{a.steps} AdamW steps in {r['train_s']:.1f} s (wall {time.perf_counter() - t0:.1f} s)")
    (l0, s0), (l1, s1) = r["losses"][0], r["losses"][-1]
    print(f"[train] loss {l0:.6f} -> {l1:.6f} distributed, {s0:.6f} -> {s1:.6f} single-device trained alone")
    print(f"[check] every step: the loss and all {r['n_grads']} gradients against a single-device copy holding the "
          f"distributed model's parameters, and the loss against the single-device model trained alone")
    print(f"[check] worst errors, in units of the fp32 tolerance |a - b| <= 1e-6 + 1e-4 |b| (1 = at it; NaN/inf "
          f"fails): loss {r['loss']:.3g}, gradients {r['grad']:.3g} ({r['grad_name']}), loss against the run "
          f"alone {r['ref_loss']:.3g}")
    ok = agreed and max(r["loss"], r["grad"], r["ref_loss"]) <= 1
    print(f"[check] {'MATCH' if ok else 'MISMATCH'}")
    return ok


def _rank(rank, world, name, steps, plan_json, out):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # full_tensor() chatter
    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    model = models.build(name)                    # the same weights on every rank
    check = _Check(model) if rank == 0 else None  # copies, before compile takes the model over
    g = torch.Generator().manual_seed(1234)
    vocab = models.get_config(name).vocab
    tokens = [torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(steps)]
    batches = [(x, (x + 1) % vocab) for x in tokens]  # a rule to learn: the next token is this one + 1
    t0 = time.perf_counter()
    dm = stpc_compile(model, tuple(plan.mesh_shape), batches[0], plan=plan)
    t1 = time.perf_counter()
    opt = torch.optim.AdamW(dm.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    bar = tqdm(total=steps, desc="[train]", file=sys.stdout, disable=not sys.stdout.isatty()) if tqdm and check \
        else None
    for step, batch in enumerate(batches):
        # every rank takes part in the gathers (full_tensor is a collective); rank 0 checks
        params = {k: p.detach().full_tensor().clone() for k, p in dm.named_parameters()}
        opt.zero_grad()
        loss = dm(*batch)
        loss.backward()
        grads = {k: p.grad.full_tensor().clone() for k, p in dm.named_parameters() if p.grad is not None}
        if check:
            check.step(step, batch, loss.detach(), params, grads)
        if bar:
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update()
        opt.step()
    if bar:
        bar.close()
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


def _compare(name, devices, batch, seq):
    """stpc's own plan against the baselines for ``name``, modelled: one trace, four searches."""
    t0 = time.perf_counter()
    tg, batch, seq = meta_trace(name, batch, seq, "fp16")
    cl = get_cluster("primepar-v100")
    budget = cl.device.mem_bytes
    print(f"\n[model] {name} on {devices} x {cl.device.name} ({cl.name}), fp16 mixed precision, AdamW, batch "
          f"{batch} x seq {seq}, budget {budget / 1e9:.0f} GB/device: MODELLED by stpc's cost model, not run")
    rows = []
    for hints, label in (("", "stpc"), *BASELINES):
        try:
            p = search(tg, devices, cl, budget_bytes=budget, hints=hints or None, dtype="fp16",
                       optimizer_layout="mixed-adam")
        except InfeasibleBudget as e:
            rows.append((label, None, f"does not fit: needs {e.min_budget / 2**30:.1f} GiB/device"))
            continue
        layout = describe_layout(p.stats.get("layout")) if hints else f"mesh {_shape(p)}"
        rows.append((label, p, f"{layout}; {_families(p.strategy_counts())}"))
    if rows[0][1] is None:
        print(f"[model] stpc {rows[0][2]}: no comparison on {devices} devices (give more: --compare-devices)")
        return
    stpc_time = rows[0][1].modelled_step_time_s
    print(f"  {'plan':16} {'step (modelled)':>16} {'peak/device':>12} {'stpc speedup':>13}  layout; families")
    for label, p, what in rows:
        if p is None:
            print(f"  {label:16} {'-':>16} {'-':>12} {'-':>13}  {what}")
            continue
        print(f"  {label:16} {p.modelled_step_time_s * 1e3:13.1f} ms {p.peak_memory_bytes / 2**30:8.2f} GiB "
              f"{p.modelled_step_time_s / stpc_time:12.2f}x  {what}")
    fits = [(p.modelled_step_time_s, label) for label, p, _ in rows[1:] if p is not None]
    if fits:
        best, label = min(fits)
        print(f"[model] stpc against the best baseline that fits ({label}): {best / stpc_time:.2f}x, modelled "
              f"({time.perf_counter() - t0:.1f} s: one trace on meta, {len(rows)} searches)")


def _shape(plan) -> str:
    return "x".join(map(str, plan.mesh_shape))


def _families(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())
