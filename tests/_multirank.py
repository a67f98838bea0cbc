"""Shared worker for the multi-rank model tests: runs on every spawned rank.

``run_cases(rank, world, cases)`` compiles each case's model under its (given) plan,
trains ``steps`` steps next to an unsharded copy of the same model and returns, per
case, the largest relative errors of the loss, of every gradient and of every
parameter after each optimizer step. It fails closed: a NaN or inf anywhere counts as
an unbounded error, never as a match.

Each step is checked in three parts, at rtol 1e-4:
  * forward and backward: loss and every full gradient against a *probe*, the
    single-device model holding the distributed model's current (gathered) parameters
    and run on the same batch;
  * the optimizer step: every parameter after it against a *shadow*, the full
    parameters, started equal, stepped by the same optimizer on the distributed
    model's own (gathered) gradients;
  * the run as a whole: the loss against the single-device model trained alone from
    the same start (its loss, at each step).
(Gradients and parameters are not held against the model trained alone: the two
programs sum in different orders, and AdamW maps a gradient element of rounding size,
e.g. a key bias's, which softmax makes zero in exact arithmetic, to a full-size step of
either sign; over 20 steps such drift moves some gradients past any fixed tolerance.
The probe sees the same parameters, so no drift reaches it.)
"""
from __future__ import annotations

import copy
import time

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / (atol + rtol*|b|) style ratio; <= 1 means within rtol=1e-4, atol=1e-6.
    A non-finite value on either side, or a shape mismatch, is infinitely far."""
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float(((a - b).abs() / (1e-6 + 1e-4 * b.abs())).max())


def full_grads(pm) -> dict:
    """FQN -> the full gradient of every parameter of a compiled model (a collective)."""
    return {k: (p.grad.full_tensor().clone() if p.grad is not None else
                torch.zeros(p.shape, dtype=p.dtype, device=p.device))
            for k, p in pm.named_parameters()}


def full_params(pm) -> dict:
    """FQN -> the full value of every parameter of a compiled model (a collective); a copy
    (a replicated DTensor's ``full_tensor()`` is its live local tensor)."""
    return {k: p.detach().full_tensor().clone() for k, p in pm.named_parameters()}


def run_cases(rank, world, cases):
    import stpc
    from stpc import models
    from stpc.planner import Plan

    results = []
    for case in cases:
        t0 = time.perf_counter()
        name, overrides, plan_json = case["model"], case.get("overrides", {}), case["plan"]
        plan = Plan.from_json(plan_json)
        device = torch.device(case.get("device", "cpu"))  # (a CUDA world: the GPU check, benchmarks/)
        torch.manual_seed(0)
        model = models.build(name, **overrides)
        ref, probe = copy.deepcopy(model).to(device), copy.deepcopy(model).to(device)
        g = torch.Generator().manual_seed(1)
        cfg = model.cfg
        steps = case.get("steps", 1)
        batches = [(torch.randint(0, cfg.vocab, (case["batch"], case["seq"]), generator=g).to(device),
                    torch.randint(0, cfg.vocab, (case["batch"], case["seq"]), generator=g).to(device))
                   for _ in range(steps)]
        dm = stpc.compile(model, tuple(plan.mesh_shape), batches[0], plan=plan,
                          backend=case.get("backend"))
        opt_name = case.get("opt", "sgd")
        mk = (lambda ps: torch.optim.SGD(ps, lr=0.5)) if opt_name == "sgd" else \
            (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
        opt = mk(list(dm.parameters()))
        ref_opt = mk(list(ref.parameters()))
        probe_params = dict(probe.named_parameters())
        shadow = {k: torch.nn.Parameter(p.detach().clone()) for k, p in probe_params.items()}
        shadow_opt = mk(list(shadow.values()))
        worst = {"loss": 0.0, "grad": 0.0, "grad_name": "", "param": 0.0, "param_name": "", "steps": 0}
        losses = []
        for step, (idx, tgt) in enumerate(batches):
            opt.zero_grad()
            ref_opt.zero_grad()
            probe.zero_grad()
            with torch.no_grad():  # the probe stands where the distributed model stands now
                for k, v in full_params(dm).items():
                    probe_params[k].copy_(v)
            loss = dm(idx, tgt)
            loss.backward()
            here = probe(idx, tgt)
            here.backward()
            ref_loss = ref(idx, tgt)
            ref_loss.backward()
            losses.append((float(loss.detach()), float(ref_loss.detach())))
            worst["loss"] = max(worst["loss"], _rel(loss.detach(), here.detach()),
                                _rel(loss.detach(), ref_loss.detach()))
            grads = full_grads(dm)
            for k, gr in grads.items():
                r = _rel(gr, probe_params[k].grad)
                if r > 1:
                    worst.setdefault("bad", []).append((k, step, round(r, 1)))
                if r > worst["grad"]:
                    worst["grad"], worst["grad_name"] = r, f"{k}@step{step}"
            missing = set(probe_params) - set(grads)
            if missing:
                worst["missing"] = sorted(missing)
            opt.step()
            ref_opt.step()
            for k, p in shadow.items():
                p.grad = grads[k] if k in grads else torch.zeros_like(p)
            shadow_opt.step()
            for k, p in full_params(dm).items():  # the sharded step did what the full one does
                r = _rel(p.detach(), shadow[k].detach())
                if r > worst["param"]:
                    worst["param"], worst["param_name"] = r, f"{k}@step{step}"
            worst["steps"] += 1
        worst["losses"] = losses
        worst["case"] = case["id"]
        worst["seconds"] = time.perf_counter() - t0
        worst["strategy_counts"] = plan.strategy_counts()
        # the collectives over several mesh axes at once (their joint group) the program runs
        worst["joint_ops"] = sorted({n.meta["comm"]["op"] for prog in dm.stpc.programs.values()
                                     for n in prog.gm.graph.nodes
                                     if isinstance(n.meta.get("comm", {}).get("axis"), tuple)})
        if case.get("backend"):
            from torch._dynamo.utils import counters
            worst["graph_breaks"] = sum(counters["graph_break"].values())
        results.append(worst)
    return results


# --------------------------------------------------------------------------- parent side: plans


def family_hints(family: str):
    """Hints that force one family of plans (None: the solver's own choice)."""
    from stpc.planner import Hints

    if family in ("megatron", "megatron-zero", "megatron-sp"):  # Megatron's TP+SP, TP on the last axis (``make_plan``'s layout)
        return family
    if family in ("solved", "solved-h100", "solved-v100", "solved-budget"):
        return None
    if family == "dp":  # batch split at every linear on every axis, weights replicated
        return "dp"
    if family in ("ag_ring", "rs_ring", "p2x2"):
        return Hints(force=[(r"^linear", lambda s, k=family: s.kind == k)], name=family)
    if family == "p2x2-seq-rows":  # every linear P2x2 with the sequence over the grid's rows
        # (batch rows are the solver's own choice where it may pick)
        return Hints(force=[(r"^linear", lambda s: s.kind == "p2x2" and s.out[0].startswith("B1."))], name=family)
    if family == "p2x2-grid":  # whole layers in grid layout: every linear P2x2, every norm kept in
        # B, and the loss reading its logits in B (runtime.grid_cross_entropy)
        return Hints(force=[(r"^linear", lambda s: s.kind == "p2x2"),
                            (r"^(layer_norm|rms_norm)", lambda s: any(t[0] == "B" for t in s.out)),
                            (r"^cross_entropy_loss", lambda s: any(t[0] == "B" for t in s.ins[0]))], name=family)
    if family == "ag_rs":  # the classic pairing: column projections AG-ring, row projections RS-ring
        return Hints(force=[(r"(q_proj|k_proj|v_proj|fc1|gate_proj|up_proj)$", lambda s: s.kind == "ag_ring"),
                            (r"(o_proj|fc2|down_proj)$", lambda s: s.kind == "rs_ring")], name="ag_rs")
    if family == "zero-kept0":  # q/k/v weights stored split over axis 0, the other linears' over
        # axis 1, all read whole; kept gathered for backward over axis 0 (ZeRO-2 there), gathered
        # again over axis 1 (ZeRO-3 there)
        return Hints(force=[(r"^linear", lambda s: s.kind == "spatial" and all(t == "R" for t in s.ins[1])
                             and all(t == "S0" for t in s.ins[0]))],
                     param_force=[(r"(q_proj|k_proj|v_proj)\.weight$", lambda p: p[0][0] == "S" and p[1] == "R"),
                                  (r"(o_proj|fc1|fc2|gate_proj|up_proj|down_proj)\.weight$",
                                   lambda p: p[0] == "R" and p[1][0] == "S"),
                                  (r".", lambda p: all(t == "R" for t in p))],
                     temporal=False, keep_gathered=(0,), name="zero-kept0")
    if family == "zero":  # data parallel (batch split on every axis), every weight stored sharded and
        # gathered whole for its linear: ZeRO-3 (all-gather forward, reduce-scatter backward)
        return Hints(force=[(r"^linear", lambda s: s.kind == "spatial" and all(t == "R" for t in s.ins[1])
                             and all(t == "S0" for t in s.ins[0]))],
                     param_force=[(r".", lambda p: all(t[0] == "S" for t in p))], temporal=False, name="zero")
    if family == "megatron-zero-whole-positions":  # data parallel with the distributed optimizer (ZeRO-2),
        # GPT's position embedding looked up whole on every rank: its weight, stored split, is
        # gathered whole for the lookup, and the lookup's output reaches batch-split work through
        # an f (the plan the VM's calibrated profile picks for gpt-50m's megatron dp 4 x tp 1)
        import dataclasses

        from stpc.planner.hints import megatron
        hints = megatron((4,), 0, None, distributed_optimizer=True)
        return dataclasses.replace(hints, force=list(hints.force) + [
            (r"^wpe$", lambda s: all(t == "R" for t in s.ins[0] + s.ins[1]))])
    if family == "fsdp-tp-outer":  # TorchTitan's FSDP + TP+SP on 2x2, TP on the outer axis (the fidelity
        # bench's fsdp-tp layout): the logits, vocab split on the outer axis and rows on the inner,
        # reach a loss that splits rows on both (one redistribution over the joint group)
        import dataclasses

        from stpc.planner.hints import fsdp_tp
        hints = fsdp_tp((2, 2), dp_axis=1, tp_axis=0, sequence_parallel=True)
        return dataclasses.replace(hints, force=list(hints.force) + [
            (r"^cross_entropy_loss", lambda s: tuple(s.ins[0]) == ("S0", "S0"))])
    raise ValueError(family)


def whole_embedding_hints():
    """Data parallel at every linear (batch-split inputs, every parameter replicated), but the
    token embedding computed on the whole batch on every rank: a tied head's gradient is then
    complete from the embedding and partial from the head, so its reduction stays in the graph."""
    from stpc.planner import Hints
    from stpc.planner.hints import TOKEN_EMBEDDING

    return Hints(force=[(r".", lambda s: s.kind == "spatial"),
                        (r"^linear", lambda s: all(t == "S0" for t in s.ins[0])),
                        (TOKEN_EMBEDDING, lambda s: all(t == "R" for t in s.ins[1]))],
                 param_force=[(r".", lambda p: all(t == "R" for t in p))], temporal=False)


# CP-SAT's wall-clock limit per candidate for the ``solved-budget`` plans (``make_plan``).
SOLVED_BUDGET_TIME_LIMIT_S = 5.0


def make_plan(model: str, mesh, family: str, batch: int, seq: int, **overrides):
    import stpc
    from stpc import models
    from stpc.planner import search

    with torch.device("meta"):
        m = models.build(model, **overrides)
    tg = stpc.trace(m, models.example_inputs(model, batch, seq))
    if isinstance(mesh, str):  # "4" -> (4,), "2x2" -> (2, 2): a fixed shape, not a search over shapes
        mesh = tuple(int(x) for x in mesh.split("x"))
    base, _, level = family.partition("+")
    count = None  # "+recompute1": only the first layer recomputed (``Hints.recompute_layers``)
    if level.rstrip("0123456789") in ("recompute", "selective") and level[-1:].isdigit():
        stripped = level.rstrip("0123456789")
        level, count = stripped, int(level[len(stripped):])
    if level in ("recompute", "selective"):  # the family's plan, its layers recomputed in backward
        import dataclasses

        from stpc.planner import Hints, preset
        hints = family_hints(base)
        if base in ("megatron", "megatron-sp", "megatron-zero"):
            hints = _megatron_hints(base, mesh)
        hints = preset(hints, mesh) if isinstance(hints, str) else (hints or Hints())
        level = "full" if level == "recompute" else level
        return search(tg, mesh, cluster="cpu-local",
                      hints=dataclasses.replace(hints, recompute=level, recompute_layers=count))
    cluster = {"solved-h100": "dgx-h100", "solved-v100": "primepar-v100"}.get(family, "cpu-local")
    budget = None
    if family == "solved-budget":  # a third of what the unconstrained plan needs: the solver must shard
        from stpc.planner.solver import InfeasibleBudget
        budget = search(tg, mesh, cluster=cluster).peak_memory_bytes / 3
        # The parity proof needs the solver's plan under a binding budget, not CP-SAT's proof
        # that no other candidate beats it: on these tiny models that proof can take minutes
        # (gpt-tiny on 2x2: nine candidates, most still unproven after 60 s each), and a plan
        # left unproven is a plan all the same (``plan.stats["unresolved"]``)
        limit = SOLVED_BUDGET_TIME_LIMIT_S
        try:
            return search(tg, mesh, cluster=cluster, budget_bytes=budget, time_limit_s=limit)
        except InfeasibleBudget as e:  # then the tightest budget that fits
            return search(tg, mesh, cluster=cluster, budget_bytes=e.min_budget * 1.001, time_limit_s=limit)
    hints = family_hints(family)
    if family in ("megatron", "megatron-sp", "megatron-zero"):
        hints = _megatron_hints(family, mesh)
    return search(tg, mesh, cluster=cluster, hints=hints, budget_bytes=budget)


def _megatron_hints(family: str, mesh: tuple):
    from stpc.planner.hints import megatron
    if family == "megatron":  # this layout, not the best of Megatron's space (``baselines``): TP+SP is the family
        return megatron(mesh)
    if family == "megatron-sp":  # the same, the glue between the linears sequence-split always
        return megatron(mesh, sequence_parallel=True)
    # megatron-zero: DP on the first axis with the distributed optimizer (ZeRO-2), TP on the second
    return megatron(mesh, 0, 1 if len(mesh) > 1 else None, distributed_optimizer=True)
