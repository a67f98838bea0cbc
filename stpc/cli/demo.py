"""The README's main job: a small GPT through the whole stpc pipeline on 4 CPU ranks.

1. trace the model on meta tensors and plan it for 4 devices (shown: mesh shape,
   modelled step time, strategy families, the plan table);
2. spawn 4 real gloo ranks; each one compiles the model with ``stpc.compile``
   (every rank plans, the ranks check they agree) and trains a few SGD-momentum steps;
3. train the same model on one device and compare loss and every gradient.
Graph dumps after each pass land in ``--out``.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from stpc.compile import compile as stpc_compile
from stpc.compile import trace
from stpc.frontend import dump, models
from stpc.planner import search
from stpc.runtime.launch import spawn


def _data(name, batch, seq, steps):
    g = torch.Generator().manual_seed(1234)
    vocab = models.get_config(name).vocab
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]


def _optimizer(params, lr):
    # SGD with momentum rather than Adam: Adam divides by sqrt(v), so a gradient that is
    # zero in exact arithmetic (the key bias: softmax ignores it) turns its fp32 rounding
    # noise into full-size, sign-random updates, and any two fp32 programs drift apart.
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _reference(name, batch, seq, steps, lr):
    """Single-device training: per-step loss and the gradients of the last step."""
    torch.manual_seed(0)
    model = models.build(name)
    opt = _optimizer(model.parameters(), lr)
    losses, grads = [], {}
    for idx, tgt in _data(name, batch, seq, steps):
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        losses.append(loss.item())
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    return losses, grads


def _rank(rank, world, name, batch, seq, steps, lr, mesh, out_dir, budget_gib=None):
    torch.manual_seed(0)
    model = models.build(name)  # same seed on every rank: identical full weights
    example = models.example_inputs(name, batch, seq, device="cpu")
    t0 = time.perf_counter()
    dm = stpc_compile(model, mesh, example, budget_gib=budget_gib)
    t_compile = time.perf_counter() - t0
    opt = _optimizer(dm.parameters(), lr)  # DTensor parameters: any torch optimizer
    losses, grads = [], {}
    for idx, tgt in _data(name, batch, seq, steps):
        opt.zero_grad()
        loss = dm(idx, tgt)
        loss.backward()
        losses.append(loss.item())
        grads = {k: p.grad.full_tensor() for k, p in dm.named_parameters()}
        opt.step()
    if rank == 0:
        dm.stpc.dump_passes(os.path.join(out_dir, "passes"))
        return {"losses": losses, "grads": grads, "plan_hash": dm.stpc.plan.hash(), "compile_s": t_compile,
                "mesh": dm.stpc.plan.mesh_shape}
    return {"plan_hash": dm.stpc.plan.hash()}


def main_demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m stpc demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mesh", default=None, help="mesh spec (default: the number of ranks; the planner "
                                                 "chooses the shape)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="out/demo", help="folder for the plan and graph dumps")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-device memory budget (default: a third of the unconstrained plan's peak, "
                        "so the planner must shard; 0 for no budget)")
    a = p.parse_args(argv)
    lr = 0.05
    mesh = a.mesh or str(a.ranks)

    os.makedirs(a.out, exist_ok=True)
    # 1. plan on meta tensors, in this process, to show it
    with torch.device("meta"):
        meta_model = models.build(a.model)
    tg = trace(meta_model, models.example_inputs(a.model, a.batch, a.seq), name=a.model)
    free = search(tg, mesh, "cpu-local")
    if a.budget_mib is None:
        budget = free.peak_memory_bytes / 3
    else:
        budget = a.budget_mib * 2**20 if a.budget_mib > 0 else None
    plan = search(tg, mesh, "cpu-local", budget_bytes=budget) if budget else free
    budget_gib = budget / 2**30 if budget else None
    print(f"[trace] {a.model}: {len(tg.graph.nodes)} nodes, {tg.num_params():,} parameters, "
          f"{tg.total_flops():.3g} forward FLOPs")
    print(f"[plan]  unconstrained: modelled step {free.modelled_step_time_s * 1e3:.3f} ms, peak "
          f"{free.peak_memory_bytes / 2**20:.2f} MiB/device, families {free.strategy_counts()}")
    if budget:
        print(f"[plan]  budget {budget / 2**20:.2f} MiB/device:")
    print(f"[plan]  mesh {'x'.join(map(str, plan.mesh_shape))} (of {len(plan.stats['mesh_shapes_tried'])} "
          f"shapes tried), modelled step {plan.modelled_step_time_s * 1e3:.3f} ms, peak "
          f"{plan.peak_memory_bytes / 2**20:.2f} MiB/device, search {plan.stats['search_time_s']:.2f} s, "
          f"families {plan.strategy_counts()}")
    plan.save(os.path.join(a.out, "plan.json"))
    with open(os.path.join(a.out, "plan.txt"), "w") as f:
        f.write(plan.table())
    dump(tg, os.path.join(a.out, "traced.txt"), plan=plan)
    print(f"[dump]  {a.out}/plan.txt, {a.out}/traced.txt (+ .dot)")

    # 2. the SPMD program on real ranks
    t0 = time.perf_counter()
    res = spawn(_rank, a.ranks, a.model, a.batch, a.seq, a.steps, lr, mesh, a.out, budget_gib, timeout_s=600)
    wall = time.perf_counter() - t0
    hashes = {r["plan_hash"] for r in res}
    r0 = res[0]
    print(f"[run]   {a.ranks} gloo ranks, plan {r0['plan_hash'][:12]} on every rank "
          f"({'agreed' if len(hashes) == 1 else 'DISAGREED'}), mesh {r0['mesh']}, "
          f"compile {r0['compile_s']:.2f} s, wall {wall:.1f} s")
    print(f"[dump]  graph after each pass: {a.out}/passes/")

    # 3. the single-device reference
    ref_losses, ref_grads = _reference(a.model, a.batch, a.seq, a.steps, lr)
    for step, (l_d, l_r) in enumerate(zip(r0["losses"], ref_losses)):
        print(f"[check] step {step}: loss distributed {l_d:.6f}  single-device {l_r:.6f}")
    # fp32 tolerance: rtol 1e-4, with an absolute floor for gradients that are zero in exact
    # arithmetic (a key bias cannot change softmax; its gradient is rounding noise).
    worst = max((d - g).abs().max().item() for k, g in ref_grads.items() for d in [r0["grads"][k]])
    grads_ok = all(torch.allclose(r0["grads"][k], g, rtol=1e-4, atol=1e-6) for k, g in ref_grads.items())
    loss_ok = all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for x, y in zip(r0["losses"], ref_losses))
    ok = len(hashes) == 1 and grads_ok and loss_ok
    print(f"[check] {len(ref_grads)} parameter gradients at the last step: max abs difference {worst:.2e} "
          f"(rtol 1e-4, atol 1e-6) -> {'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1
