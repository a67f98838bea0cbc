"""The CUDA path of stpc, checked on a machine with a GPU (CI has none; run it where one is lent):

    python benchmarks/cuda_check.py [--ranks 4] [--steps 10] [--batch 16] [--bf16 MODEL LAYERS BATCH SEQ]
                                    [--parity-families FAMILY ...] [--json FILE] [--markdown FILE]

1. **Parity on CUDA.** ``stpc.compile`` on a CUDA mesh, trained ``--steps`` AdamW steps
   next to the single-device model by the multi-rank tests' own worker
   (``tests/_multirank.run_cases`` with ``device="cuda"``): the loss, every gradient and
   every parameter after each step, fp32 with TF32 off, at the tests' bound (rtol 1e-4).
   First on one rank over NCCL (a mesh of one: the NCCL path, eager and inductor, on any
   GPU), then on ``--ranks`` ranks with the parity tests' families (data parallel, Megatron
   TP+SP, AG/RS rings, P(2x2), the solved plan, recomputed layers; ``--parity-families``
   picks some), eager and inductor: one rank per
   GPU over NCCL where the machine has that many, else ranks sharing the GPUs with CUDA
   tensors over gloo (``cpu:gloo,cuda:gloo``; gloo cannot send a CUDA tensor point to
   point, so every plan with a ring fails there, and ``probe_gloo_cuda`` says which
   collectives gloo does run on CUDA).
2. **Memory and time: the CUDA allocator and the clock against the planner.** The
   fidelity bench's GPT (``stpc.cli.bench_fidelity.DEFAULTS``, at ``--batch``) planned on
   ``dgx-h100`` on ``--memory-ranks`` ranks (1 by default: solved and recomputed, eager and
   inductor), one plan at a time: each rank's ``torch.cuda.max_memory_allocated`` over
   ``PEAK_STEPS`` steps (after one; what was allocated before compiling subtracted)
   against the predicted per-device peak, and the median synchronised step of the next
   ``--steps`` against the modelled step time. (The caching allocator rounds blocks up to
   512 bytes; ``max_memory_allocated`` counts bytes handed out, not reserved segments.)

3. **bf16 step time against the model of RESULTS.md's H100 cells.** ``--bf16`` (a zoo
   model cut to a depth, llama2-7b at 4 layers by default) in bf16 on one GPU, planned on
   ``dgx-h100``: the modelled step against the measured median, eager and inductor; and
   where forward + backward goes: the device time of the CUDA kernels of one profiled
   forward + backward by kind (GEMM, attention, the rest: ``kernel_kind``) against the
   model's compute of the same kinds (``stpc.planner.summary.compute_by_op``).

Prints one JSON line per case; ``--json`` keeps them all, ``--markdown`` writes the
RESULTS.md section (``--from-json`` renders it from an earlier run's ``--json``).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import _multirank  # noqa: E402  (the parity tests' worker and plans)
from stpc import compile as stpc_compile, models  # noqa: E402
from stpc.cli import bench_fidelity  # noqa: E402
from stpc.planner import Plan  # noqa: E402
from stpc.runtime.launch import SpawnError, SpawnTimeout, spawn  # noqa: E402

PARITY = [  # (model, family, overrides, backend)
    ("gpt-tiny", "dp", {}, None),  # all-reduces alone: the bucketed reducer and the loss read late
    ("gpt-tiny", "megatron", {}, None), ("llama-tiny", "ag_rs", {}, None), ("gpt-tiny", "p2x2", {"bias": False}, None),
    ("llama-tiny", "solved", {}, None), ("gpt-tiny", "megatron+recompute", {}, None),
    ("gpt-tiny", "dp", {}, "inductor"), ("gpt-tiny", "megatron", {}, "inductor"), ("llama-tiny", "ag_rs", {}, "inductor"),
]
SINGLE = [("llama-tiny", "solved", {}, None), ("gpt-tiny", "solved+recompute", {}, None),
          ("llama-tiny", "solved", {}, "inductor")]  # a mesh of one: NCCL on one GPU
PEAK_STEPS = 3


def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _parity_worker(rank, world, cases):
    _no_tf32()
    return _multirank.run_cases(rank, world, cases)


def parity(world: int, backend: str, steps: int, only=None) -> list[dict]:
    """Each case of PARITY (``world`` > 1) or SINGLE; ``only``: the families to run (all if None)."""
    out = []
    cases = PARITY if world > 1 else SINGLE
    for model, family, overrides, compiler in cases:
        if only is not None and family not in only:
            continue
        if family == "p2x2" and world != 4:
            continue
        mesh = "4" if family in ("ag_rs", "p2x2") and world == 4 else str(world)
        case_id = f"{model}/{family}/{compiler or 'eager'}/{world}x{backend}"
        rec = {"check": "parity", "case": case_id, "ranks": world, "backend": backend}
        t0 = time.perf_counter()
        try:
            plan = _multirank.make_plan(model, mesh, family, batch=4, seq=16, **overrides)
            case = {"id": case_id, "model": model, "overrides": overrides, "plan": plan.to_json(), "batch": 4,
                    "seq": 16, "steps": steps, "opt": "adamw", "backend": compiler, "device": "cuda"}
            res = spawn(_parity_worker, world, [case], timeout_s=900, backend=backend)[0][0]
            ok = max(res["loss"], res["grad"], res["param"]) <= 1 and "missing" not in res
            rec.update({"ok": ok, "worst_loss": res["loss"], "worst_grad": res["grad"], "grad_at": res["grad_name"],
                        "worst_param": res["param"], "param_at": res["param_name"], "steps": res["steps"],
                        "graph_breaks": res.get("graph_breaks"), "families": plan.strategy_counts()})
        except (SpawnError, SpawnTimeout, Exception) as e:  # noqa: BLE001 - a case's failure is its result
            rec.update({"ok": False, "error": f"{type(e).__name__}: {str(e)[-1500:]}"})
        rec["seconds"] = time.perf_counter() - t0
        out.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "families"}), flush=True)
    return out


def _model_and_batch(cfg, build):
    """(this rank's GPU, ``build(device)`` after seeding, one batch of token ids and targets
    of ``cfg``'s batch x seq on that GPU)."""
    _no_tf32()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = build(dev)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.cfg.vocab, (cfg["batch"], cfg["seq"]), generator=g).to(dev)
    tgt = torch.randint(0, model.cfg.vocab, (cfg["batch"], cfg["seq"]), generator=g).to(dev)
    return dev, model, idx, tgt


def _memory_worker(rank, world, cfg, plans):
    dev, base, idx, tgt = _model_and_batch(  # (built on the CPU: each plan compiles a copy of it)
        cfg, lambda _: models.build(cfg["model"], **bench_fidelity.model_overrides(cfg)))
    out = []
    for rec, compiler in ((r, c) for r in plans for c in cfg["backends"]):
        plan = Plan.from_json(rec["plan_json"])
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        pm = stpc_compile(copy.deepcopy(base), tuple(plan.mesh_shape), (idx, tgt), plan=plan, cache=False,
                          backend=compiler)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
        times = []
        for step in range(1 + PEAK_STEPS + cfg["steps"]):
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            pm(idx, tgt).backward()
            opt.step()
            torch.cuda.synchronize()
            if step > PEAK_STEPS:
                times.append(time.perf_counter() - t0)
        peak = torch.tensor([float(torch.cuda.max_memory_allocated() - before), statistics.median(times)],
                            dtype=torch.float64)
        every = [torch.zeros_like(peak) for _ in range(world)]
        if dist.get_backend() == "nccl":
            every = [t.to(dev) for t in every]
            dist.all_gather(every, peak.to(dev))
        else:
            dist.all_gather(every, peak)
        out.append({"plan": rec["plan"], "backend": compiler or "eager", "peaks": [int(t[0].item()) for t in every],
                    "step_s": max(float(t[1].item()) for t in every)})
        del pm, opt
    return out


def _head(msg: str, n: int = 3000) -> str:
    """A rank's failure, cut to its first ``n`` characters: a native crash's report opens with
    the signal and the Python stack of each thread (``spawn``'s faulthandler) and ends with a
    long list of loaded extension modules."""
    return msg if len(msg) <= n else msg[:n] + " [...]"


def memory(world: int, backend: str, batch: int, steps: int, names=None) -> list[dict]:
    """The memory and time check of ``names`` (the fidelity bench's plans; by default solved
    and recompute on one rank, all of them on more), each plan in a spawn of its own: a plan
    the backend cannot run (gloo sends no CUDA tensor point to point, which every ring does)
    fails alone, with its error as its record."""
    names = names or (("solved", "recompute") if world == 1 else
                      [p for p in bench_fidelity.DEFAULT_PLANS if world == 4 or p != "p2x2"])
    cfg = {**bench_fidelity.DEFAULTS, "ranks": world, "cluster": "dgx-h100", "plans": list(names), "batch": batch,
           "steps": steps, "backends": [None, "inductor"] if world == 1 else [None]}
    t0 = time.perf_counter()
    try:
        plans = bench_fidelity.make_plans(cfg)
    except Exception as e:  # noqa: BLE001
        rec = {"check": "memory", "ranks": world, "backend": backend, "ok": False,
               "error": f"{type(e).__name__}: {str(e)[-1500:]}", "seconds": time.perf_counter() - t0}
        print(json.dumps(rec), flush=True)
        return [rec]
    by_name = {r["plan"]: r for r in plans}
    got, out = [], []
    for one in plans:
        t1 = time.perf_counter()
        try:
            got += spawn(_memory_worker, world, cfg, [one], timeout_s=900, backend=backend)[0]
        except (SpawnError, SpawnTimeout, Exception) as e:  # noqa: BLE001 - a plan's failure is its result
            rec = {"check": "memory", "plan": one["plan"], "ranks": world, "backend": backend, "ok": False,
                   "families": one.get("families"), "error": f"{type(e).__name__}: {_head(str(e))}",
                   "seconds": time.perf_counter() - t1}
            print(json.dumps(rec), flush=True)
            out.append(rec)
    for m in got:
        rec = by_name[m["plan"]]
        pred, meas = rec["predicted_peak_bytes"], max(m["peaks"])
        r = {"check": "memory", "plan": m["plan"], "compiler": m["backend"], "layout": rec["layout"] or rec["mesh"],
             "ranks": world, "backend": backend, "cluster": rec["cluster"],
             "model": f"{cfg['model']} d{cfg['d_model']} L{cfg['layers']}", "batch": cfg["batch"], "seq": cfg["seq"],
             "predicted_peak_bytes": pred, "cuda_peak_bytes": meas, "cuda_peak_bytes_per_rank": m["peaks"],
             "memory_error": pred / meas - 1, "predicted_step_s": rec["predicted_step_s"],
             "measured_step_s": m["step_s"], "time_error": rec["predicted_step_s"] / m["step_s"] - 1,
             "predicted_parts": rec["predicted_parts"]}
        out.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "predicted_parts"}), flush=True)
    return out


def _build_on(name, layers, dtype, dev):
    with dev:
        return models.build(name, n_layers=layers).to(dtype)


def _bf16_worker(rank, world, cfg, plan_json):
    _, model, idx, tgt = _model_and_batch(cfg, lambda dev: _build_on(cfg["model"], cfg["layers"], torch.bfloat16, dev))
    plan = Plan.from_json(plan_json)
    out = []
    for compiler in (None, "inductor"):
        pm = stpc_compile(copy.deepcopy(model), tuple(plan.mesh_shape), (idx, tgt), plan=plan, cache=False,
                          backend=compiler)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
        times, fb = [], []
        for step in range(3 + cfg["steps"]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            pm(idx, tgt).backward()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            if step >= 3:
                times.append(time.perf_counter() - t0)
                fb.append(t1 - t0)
        out.append({"compiler": compiler or "eager", "step_s": statistics.median(times),
                    "fwd_bwd_s": statistics.median(fb), "kernels_s": _profiled_kernels(pm, idx, tgt, opt)})
        del pm, opt
        gc.collect()
        torch.cuda.empty_cache()
    return out


# Kernel names by kind, for a profile of a step on CUDA: cuBLAS/CUTLASS GEMMs (Hopper's
# nvjet and sm90 xmma kernels, older GPUs' ampere_/volta_ ones), flash/memory-efficient
# attention, the optimizer's foreach kernels; the rest (elementwise, norms, reductions,
# copies, inductor's fused Triton kernels) is "other".
KERNEL_KINDS = (("attention", re.compile(r"flash|fmha|attention|attn", re.I)),
                ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|wgmma|sm\d+_.*(?:hmma|s\d+)", re.I)),
                ("optimizer", re.compile(r"multi_tensor_apply|foreach", re.I)))


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its name: attention, gemm, optimizer or other."""
    for kind, pattern in KERNEL_KINDS:
        if pattern.search(name):
            return kind
    return "other"


def op_kind(op: str) -> str:
    """The kind of an aten op of the planner's graph (``stpc.planner.summary.compute_by_op``'s
    keys), as :func:`kernel_kind` sorts the kernels it runs."""
    if op == "optimizer":
        return "optimizer"
    if "scaled_dot_product" in op:
        return "attention"
    if any(f"aten.{m}." in op for m in ("linear", "mm", "bmm", "matmul", "addmm")):
        return "gemm"
    return "other"


def _profiled_kernels(pm, idx, tgt, opt) -> dict:
    """Device seconds of one forward + backward by kernel kind (the optimizer step not profiled:
    it is timed on its own), from the CUDA kernels the profiler records."""
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pm(idx, tgt).backward()
        torch.cuda.synchronize()
    out = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    top: dict = {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        sec = e.duration_ns() / 1e9
        out[kernel_kind(e.name())] += sec
        top[e.name()[:90]] = top.get(e.name()[:90], 0.0) + sec
    out["top"] = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    return out


def bf16_time(model: str, layers: int, batch: int, seq: int, steps: int) -> list[dict]:
    """A zoo model in bf16 on one GPU: the step time the planner models on ``dgx-h100`` (the
    cluster of RESULTS.md's modelled H100 cells) against the measured median, eager and
    inductor. Time only: the planner's bf16 memory is mixed precision (fp32 master weights,
    ``mixed-adam``), the run here plain bf16 AdamW."""
    from stpc.cli._common import meta_trace
    from stpc.planner import search
    from stpc.planner.summary import breakdown, compute_by_op

    cfg = {"model": model, "layers": layers, "batch": batch, "seq": seq, "steps": steps}
    t0 = time.perf_counter()
    try:
        tg, _, _ = meta_trace(model, batch, seq, "bf16", layers)
        plan = search(tg, 1, cluster="dgx-h100", dtype="bf16", optimizer_layout="mixed-adam")
        got = spawn(_bf16_worker, 1, cfg, plan.to_json(), timeout_s=900, backend="nccl")[0]
    except (SpawnError, SpawnTimeout, Exception) as e:  # noqa: BLE001
        rec = {"check": "bf16-time", "model": model, "ok": False, "error": f"{type(e).__name__}: {str(e)[-1500:]}",
               "seconds": time.perf_counter() - t0}
        print(json.dumps(rec), flush=True)
        return [rec]
    parts = breakdown(plan) or {}
    by_kind: dict = {}
    for op, sec in compute_by_op(plan).items():
        by_kind[op_kind(op)] = by_kind.get(op_kind(op), 0.0) + sec
    out = []
    for m in got:
        r = {"check": "bf16-time", "model": f"{model} ({layers} layers)", "batch": batch, "seq": seq,
             "compiler": m["compiler"], "predicted_step_s": plan.modelled_step_time_s,
             "predicted_compute_s": parts.get("compute_s"), "predicted_optimizer_s": parts.get("optimizer_step_s"),
             "predicted_compute_by_kind_s": by_kind, "measured_kernels_s": m["kernels_s"],
             "measured_step_s": m["step_s"], "measured_fwd_bwd_s": m["fwd_bwd_s"],
             "time_error": plan.modelled_step_time_s / m["step_s"] - 1}
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


GLOO_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "send_recv")


def _gloo_op_worker(rank, world, op):
    x = torch.arange(8, dtype=torch.float32, device="cuda") + rank
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(torch.empty(8 * world, device="cuda"), x)
    elif op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(torch.empty(8 // world if 8 % world == 0 else 8, device="cuda"), x)
    elif op == "all_to_all_single":
        dist.all_to_all_single(torch.empty_like(x), x)
    else:
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, torch.empty_like(x),
                                                                          (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    torch.cuda.synchronize()
    return True


def probe_gloo_cuda(world: int) -> list[dict]:
    """Which collectives gloo runs on CUDA tensors (ranks sharing one GPU): each in its own ranks."""
    out = []
    for op in GLOO_OPS:
        try:
            spawn(_gloo_op_worker, world, op, timeout_s=120, backend="cpu:gloo,cuda:gloo")
            rec = {"check": "gloo-cuda", "op": op, "ok": True}
        except (SpawnError, SpawnTimeout, Exception) as e:  # noqa: BLE001
            first = str(e).strip().splitlines()
            rec = {"check": "gloo-cuda", "op": op, "ok": False, "error": " | ".join(first[-3:])[-400:]}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def _why(error: str) -> str:
    """One line of a failure: the exit of a rank that died (and, where faulthandler's stack came
    back with it, the innermost stpc frame it died in), else the exception's last line."""
    lines = [ln.strip() for ln in error.replace(" | ", "\n").splitlines()
             if ln.strip() and not ln.strip().startswith("(ranks")]
    died = [ln for ln in lines if "exited with code" in ln]
    if died:
        code = died[0].split("exited with code", 1)[1].split()[0]
        where = next((ln for ln in lines if ln.startswith("File ") and "/stpc/" in ln), None)
        if where:  # 'File ".../stpc/runtime/reshard.py", line 157 in _ag_impl'
            path, rest = where.split('"')[1], where.split('"')[2]
            where = f" in {path[path.rindex('/stpc/') + 1:]}{rest.replace(', line', ' line')}"
        return f"a rank died with exit code {code}" + (" (SIGSEGV)" if code == "-11" else "") + (where or "")
    if "Extension modules:" in error or ("torch._C" in error and "(total: " in error):  # (its closing list)
        return "a rank died of a fatal signal (faulthandler's report; its stack is cut off in this record)"
    return lines[-1][:200] if lines else "?"


def _mib(x):
    return f"{x / 2**20:,.0f}"


def markdown(doc: dict, command: str) -> str:
    """The RESULTS.md section of one run's JSON."""
    recs = doc["records"]
    lines = ["## CUDA: stpc on a GPU (benchmarks/cuda_check.py)", "", f"Command: `{command}`", "",
             f"{doc['device']} ({doc['gpus']} GPU), torch {doc['torch']}; {doc.get('date', '')}", ""]
    par = [r for r in recs if r["check"] == "parity"]
    if par:
        lines += ["Parity: `stpc.compile` on a CUDA mesh against the single-device model, AdamW, fp32 (TF32 off); "
                  "worst error over every step as a multiple of the tests' bound (rtol 1e-4, atol 1e-6; <= 1 passes).",
                  "", "| case | ranks, backend | steps | loss | gradients | parameters | graph breaks | result |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in par:
            if "error" in r:
                lines.append(f"| {r['case'].rsplit('/', 1)[0]} | {r['ranks']}, {r['backend']} | - | - | - | - | - | "
                             f"failed: {_why(r['error'])} |")
            else:
                lines.append(f"| {r['case'].rsplit('/', 1)[0]} | {r['ranks']}, {r['backend']} | {r['steps']} | "
                             f"{r['worst_loss']:.3f} | {r['worst_grad']:.3f} | {r['worst_param']:.3f} | "
                             f"{r['graph_breaks'] if r['graph_breaks'] is not None else '-'} | "
                             f"{'pass' if r['ok'] else 'FAIL'} |")
        lines.append("")
    gl = [r for r in recs if r["check"] == "gloo-cuda"]
    if gl:
        lines += ["Collectives on CUDA tensors over gloo (ranks sharing the one GPU; each op in its own ranks): " +
                  "; ".join(f"`{r['op']}` {'ran' if r['ok'] else 'failed: ' + _why(r['error'])}" for r in gl)
                  + ".", ""]
    mem = [r for r in recs if r["check"] == "memory" and "error" not in r]
    if mem:
        r0 = mem[0]
        lines += [f"Memory and step time: {r0['model']} (the fidelity bench's GPT), batch {r0['batch']} x seq "
                  f"{r0['seq']}, fp32 AdamW (foreach), planned on `{r0['cluster']}`; measured: the CUDA caching "
                  "allocator's `max_memory_allocated` over 3 steps after one (what was allocated before compiling "
                  "subtracted), and the median step of the next ones (synchronised).", "",
                  "| plan | compiler | ranks | predicted peak MiB | CUDA peak MiB | error | predicted step ms (modelled) "
                  "| measured step ms | error |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mem:
            lines.append(f"| {r['plan']} | {r['compiler']} | {r['ranks']} | {_mib(r['predicted_peak_bytes'])} | "
                         f"{_mib(r['cuda_peak_bytes'])} | {r['memory_error']:+.1%} | {r['predicted_step_s'] * 1e3:.1f} | "
                         f"{r['measured_step_s'] * 1e3:.1f} | {r['time_error']:+.1%} |")
        lines.append("")
    bf = [r for r in recs if r["check"] == "bf16-time" and "error" not in r]
    if bf:
        r0 = bf[0]
        lines += [f"bf16 step time: {r0['model']}, batch {r0['batch']} x seq {r0['seq']}, one GPU, AdamW (foreach), "
                  "planned on `dgx-h100` (bf16): the modelled step against the measured median (synchronised). Time "
                  "only: the planner's bf16 memory is mixed precision, the run plain bf16.", "",
                  "| compiler | predicted step ms (modelled) | of which optimizer ms | measured step ms | "
                  "of which forward + backward ms | optimizer ms | error |", "|---|---|---|---|---|---|---|"]
        for r in bf:
            lines.append(f"| {r['compiler']} | {r['predicted_step_s'] * 1e3:.1f} | "
                         f"{(r['predicted_optimizer_s'] or 0) * 1e3:.1f} | {r['measured_step_s'] * 1e3:.1f} | "
                         f"{r['measured_fwd_bwd_s'] * 1e3:.1f} | "
                         f"{(r['measured_step_s'] - r['measured_fwd_bwd_s']) * 1e3:.1f} | {r['time_error']:+.1%} |")
        lines.append("")
        kinds = [r for r in bf if r.get("measured_kernels_s")]
        if kinds:
            lines += ["Where forward + backward goes: the model's compute by op kind (`compute_by_op`: each op's "
                      "forward + backward on the device, at the preset's rates) against the device time of the "
                      "CUDA kernels of one profiled forward + backward, sorted by kernel name (`kernel_kind`). "
                      "The kernels' sum leaves out the host's gaps between them; the wall-clock forward + backward "
                      "is in the table above.", "",
                      "| compiler | kind | modelled ms | measured kernel ms | model / measured |",
                      "|---|---|---|---|---|"]
            for r in kinds:
                pred, meas = r["predicted_compute_by_kind_s"], r["measured_kernels_s"]
                for kind in ("gemm", "attention", "other"):
                    p, m = pred.get(kind, 0.0), meas.get(kind, 0.0)
                    lines.append(f"| {r['compiler']} | {kind} | {p * 1e3:.2f} | {m * 1e3:.2f} | "
                                 f"{p / m:.2f} |" if m > 0 else f"| {r['compiler']} | {kind} | {p * 1e3:.2f} | - | - |")
                p = sum(v for k, v in pred.items() if k != "optimizer")
                m = sum(meas.get(k, 0.0) for k in ("gemm", "attention", "other", "optimizer"))
                lines.append(f"| {r['compiler']} | all but the optimizer | {p * 1e3:.2f} | {m * 1e3:.2f} | "
                             f"{p / m:.2f} |" if m > 0 else f"| {r['compiler']} | all but the optimizer | {p * 1e3:.2f} | - | - |")
            lines.append("")
            for r in kinds:
                top = r["measured_kernels_s"].get("top") or []
                if top:
                    lines.append(f"{r['compiler']}, the longest kernels: " + "; ".join(
                        f"`{name}` {sec * 1e3:.2f} ms" for name, sec in top[:8]) + ".")
                    lines.append("")
    for r in recs:
        if r["check"] in ("memory", "bf16-time") and "error" in r:
            what = f"{r['check']} check of the {r['plan']} plan" if r.get("plan") else f"{r['check']} check"
            where = f" ({r['ranks']} ranks, {r['backend']})" if "ranks" in r and "backend" in r else ""
            lines += [f"The {what}{where} failed: {_why(r['error'])}.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="the memory check's global batch (default: %(default)s)")
    ap.add_argument("--memory-ranks", type=int, default=1, help="ranks of the memory check (default: %(default)s)")
    ap.add_argument("--memory-plans", nargs="*", choices=bench_fidelity.KNOWN_PLANS,
                    help="the memory check's plans (default: solved and recompute on one rank, the fidelity "
                    "bench's on more)")
    ap.add_argument("--json")
    ap.add_argument("--bf16", nargs=4, metavar=("MODEL", "LAYERS", "BATCH", "SEQ"),
                    default=["llama2-7b", "4", "4", "2048"], help="the bf16 step-time check's zoo model, its depth, "
                    "batch and seq (default: %(default)s)")
    ap.add_argument("--parity-families", nargs="*", help="the multi-rank parity cases to run, by family "
                    "(default: all; over gloo every plan with a ring or an all-gather dies, see the docstring)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["parity", "memory", "single", "gloo", "bf16"])
    ap.add_argument("--markdown", help="write the RESULTS.md section of this run (or of --from-json) here")
    ap.add_argument("--from-json", help="render --markdown from an earlier run's --json, running nothing")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        with open(args.markdown, "w") as f:
            f.write(markdown(doc, doc.get("command", "")) + "\n")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    n_gpu = torch.cuda.device_count()
    backend = "nccl" if n_gpu >= args.ranks else "cpu:gloo,cuda:gloo"
    head = {"device": torch.cuda.get_device_name(), "gpus": n_gpu, "torch": torch.__version__,
            "ranks": args.ranks, "backend": backend, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python benchmarks/cuda_check.py " + " ".join(sys.argv[1:])}
    print(json.dumps(head), flush=True)
    records = []
    if "single" not in args.skip:
        records += parity(1, "nccl", args.steps)
    if "parity" not in args.skip:
        records += parity(args.ranks, backend, args.steps, args.parity_families)
    if "gloo" not in args.skip and backend != "nccl":
        records += probe_gloo_cuda(args.ranks)
    if "memory" not in args.skip:
        mr = args.memory_ranks
        records += memory(mr, "nccl" if n_gpu >= mr else "cpu:gloo,cuda:gloo", args.batch, args.steps,
                          args.memory_plans)
    if "bf16" not in args.skip:
        name, layers, batch, seq = args.bf16
        records += bf16_time(name, int(layers), int(batch), int(seq), args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**head, "records": records}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown({**head, "records": records}, head["command"]) + "\n")
    return 0 if all(r.get("ok", True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
