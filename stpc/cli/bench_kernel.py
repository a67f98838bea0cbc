"""``python -m stpc bench kernel``: the Triton ring-step kernel against ``torch.addmm``.

Every AG/RS ring of ``stpc.runtime.ops.ring`` is a loop of partial GEMMs, one per ring
step, each written (or accumulated) into a slice of the output by
``stpc.runtime.ops.kernels.ring_step_matmul``, which on CUDA is a Triton kernel. This
benchmark times that kernel against ``torch.addmm`` on the step shapes of ``--model``
(llama2-7b) on ``--sizes`` devices (4 and 8).

The shapes (:func:`ring_step_shapes`): one layer's linears with Megatron's tensor + sequence
parallel roles (``stpc.planner.hints``' COLUMN and ROW patterns), decomposed into rings over
all P devices as ``passes.ring_decompose`` does: a column-parallel linear (q/k/v/gate/up)
as an AG-ring, ``all_gather(x) @ w``, a row-parallel one (o/down) as an RS-ring,
``reduce_scatter(x @ w)``; the tokens (``--batch`` x ``--seq``) split P ways on the ring's
dim. With T tokens, a linear ``in -> out`` and P devices, the steps are (``m x k @ k x n``):

=========  ==========================  ==========================  ==========================
ring       forward                     backward dX                 backward dW (accumulated)
=========  ==========================  ==========================  ==========================
AG-ring    T/P x in @ in x out/P       T/P x out/P @ out/P x in    in x T/P @ T/P x out/P
RS-ring    T/P x in/P @ in/P x out     T/P x out @ out x in/P      in/P x T/P @ T/P x out
=========  ==========================  ==========================  ==========================

(the backward ops of ``ring.py``: ``_ring_allgather_matmul_backward`` and
``_ring_matmul_reducescatter_backward``). Identical shapes are measured once. A ring over
the sequence dim passes ``[batch, seq/P, .]`` blocks into strided slices of the output; they
are measured here as the 2-D ``m x k`` GEMM of the same FLOPs into a whole output.

Measured (CUDA only): each shape in ``--dtype``, both sides accumulating into the same
output (``out += a @ b``: the kernel with ``accumulate=True``, ``out.addmm_(a, b)``), the
dW steps' ``a`` transposed as the ring passes it, two ways:

* GPU time (the kernel's own speed): ``--reps`` calls captured in one CUDA graph, the
  median over ``--iters`` replays (CUDA events) divided by ``--reps``. The launches cost
  nothing on the GPU's timeline there, so this is what the GEMMs themselves take;
* call time (what an eager ring step pays): ``--warmup`` calls, then the median of
  ``--iters`` single calls, each between two CUDA events recorded around the Python call.
  The GPU idles while the call is launched, so a step shorter than its launch (Triton's
  Python launcher and autotuner wrapper take tens of microseconds, ``addmm_`` a few) is
  timed at its launch: this measures the launch path as much as the kernel.

TFLOP/s = 2mkn / time. Without a CUDA device (or without triton) the section says not
measured and lists the shapes.
"""
from __future__ import annotations

import re
import statistics

import torch

from stpc.cli._common import TORCH_DTYPES, Parser, add_flags, verb, write_json
from stpc.frontend import models
from stpc.planner.hints import COLUMN, ROW
from stpc.runtime.ops import kernels
from stpc.runtime.ops.kernels import HAS_TRITON, triton_ring_step_matmul

DEFAULT_SIZES = (4, 8)


def layer_linears(model: str) -> list[tuple[str, int, int, str]]:
    """(name, in features, out features, ring) of the first layer's linears that Megatron
    splits: column-parallel ones as ``ag_ring``, row-parallel ones as ``rs_ring``."""
    with torch.device("meta"):
        m = models.build(model, n_layers=1)
    out = []
    for name, mod in m.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not re.match(r"(.*\.)?layers\.0\.", name):
            continue
        ring = "ag_ring" if re.search(COLUMN, name) else "rs_ring" if re.search(ROW, name) else None
        if ring:
            out.append((name.rsplit(".", 1)[-1], mod.in_features, mod.out_features, ring))
    return out


def step_gemms(ring: str, tokens: int, d_in: int, d_out: int, p: int) -> list[tuple[str, int, int, int]]:
    """(phase, m, k, n) of one step of each GEMM the ring runs (module docstring's table)."""
    t = tokens // p
    if ring == "ag_ring":
        return [("forward", t, d_in, d_out // p), ("backward dX", t, d_out // p, d_in),
                ("backward dW", d_in, t, d_out // p)]
    return [("forward", t, d_in // p, d_out), ("backward dX", t, d_out, d_in // p),
            ("backward dW", d_in // p, t, d_out)]


def ring_step_shapes(model: str, sizes, batch: int, seq: int) -> list[dict]:
    """The distinct ring-step GEMMs of ``model`` on each of ``sizes`` devices, each with the
    linears and phases that run it."""
    seen: dict[tuple, dict] = {}
    for p in sizes:
        for name, d_in, d_out, ring in layer_linears(model):
            for phase, m, k, n in step_gemms(ring, batch * seq, d_in, d_out, p):
                transposed = phase.endswith("dW")   # the ring passes dW's a as x_block^T
                rec = seen.setdefault((p, m, k, n, transposed), {"devices": p, "m": m, "k": k, "n": n,
                                                                 "a_transposed": transposed, "uses": {}})
                rec["uses"].setdefault(f"{ring} {phase}", []).append(name)
    return [{**r, "uses": [f"{', '.join(names)} {what}" for what, names in r["uses"].items()]} for r in seen.values()]


def cuda_median_s(fn, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (CUDA events), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def cuda_graph_median_s(fn, reps: int, iters: int) -> float:
    """Median GPU seconds of one ``fn()``: ``reps`` calls captured in a CUDA graph (after
    warm-up calls on a side stream, as capture requires), the median of ``iters`` timed
    replays divided by ``reps``. Launch overhead stays off the GPU's timeline."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    del graph
    return statistics.median(times)


def measure(shape: dict, dtype: torch.dtype, warmup: int, iters: int, reps: int = 20) -> dict:
    """Triton kernel and ``addmm_`` on one shape: seconds, TFLOP/s, and whether they agree."""
    m, k, n = shape["m"], shape["k"], shape["n"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    a = (torch.randn(k, m, generator=g, device=dev, dtype=dtype).t() if shape["a_transposed"]
         else torch.randn(m, k, generator=g, device=dev, dtype=dtype))
    b = torch.randn(k, n, generator=g, device=dev, dtype=dtype)
    out_triton = torch.zeros(m, n, device=dev, dtype=dtype)
    out_torch = torch.zeros(m, n, device=dev, dtype=dtype)
    triton_ring_step_matmul(a, b, out_triton, True)  # (the first call of a shape autotunes its tile)
    best = getattr(kernels, "_ring_step_mm_tuned", None)
    c = best.best_config if best is not None else None
    tile = (f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}, {c.num_warps} warps, "
            f"{c.num_stages} stages" if c is not None else "64x64x32")
    out_torch.addmm_(a, b)
    agree = bool(torch.allclose(out_triton.float(), out_torch.float(), rtol=2e-2, atol=2e-2 * k ** 0.5))
    run_triton = lambda: triton_ring_step_matmul(a, b, out_triton, True)  # noqa: E731
    run_torch = lambda: out_torch.addmm_(a, b)  # noqa: E731
    g_triton = cuda_graph_median_s(run_triton, reps, iters)
    g_torch = cuda_graph_median_s(run_torch, reps, iters)
    t_triton = cuda_median_s(run_triton, warmup, iters)
    t_torch = cuda_median_s(run_torch, warmup, iters)
    flops = 2.0 * m * k * n
    return {**shape, "triton_gpu_s": g_triton, "addmm_gpu_s": g_torch,
            "triton_gpu_tflops": flops / g_triton / 1e12, "addmm_gpu_tflops": flops / g_torch / 1e12,
            "triton_over_addmm_gpu": g_torch / g_triton,
            "triton_s": t_triton, "addmm_s": t_torch,
            "triton_tflops": flops / t_triton / 1e12, "addmm_tflops": flops / t_torch / 1e12,
            "triton_over_addmm": t_torch / t_triton, "agree": agree, "triton_tile": tile}


def why_not_measured() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not HAS_TRITON:
        return "triton is not installed"
    return None


def report(cfg: dict, rows: list[dict], reason: str | None, machine: str, command: str) -> str:
    lines = ["## Ring-step kernel: Triton against torch.addmm", "", f"Command: `{command}`", "", machine, "",
             f"The ring-step GEMMs of `{cfg['model']}` on {', '.join(map(str, cfg['sizes']))} devices at "
             f"{cfg['batch']} x {cfg['seq']} tokens: each column-parallel linear as an AG-ring, each row-parallel "
             "one as an RS-ring over all devices, one step of each of its forward, dX and dW GEMMs "
             "(`stpc.cli.bench_kernel` says how). m x k @ k x n, accumulated into the output.", ""]
    if reason:
        lines += [f"**Not measured: {reason}.** The shapes it would measure, in {cfg['dtype']}:", "",
                  "| devices | m | k | n | a transposed | GFLOP per step | used by |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['devices']} | {r['m']} | {r['k']} | {r['n']} | {'yes' if r['a_transposed'] else 'no'} | "
                  f"{2 * r['m'] * r['k'] * r['n'] / 1e9:.2f} | {'; '.join(r['uses'])} |" for r in rows]
        return "\n".join(lines) + "\n"
    lines += [f"{torch.cuda.get_device_name()}, {cfg['dtype']}. GPU time: {cfg['reps']} calls in one CUDA graph, "
              f"the median of {cfg['iters']} replays per call; call time: {cfg['warmup']} warm-up calls, then the "
              f"median of {cfg['iters']} single calls, the Python launch included (CUDA events; the module "
              "docstring says why both).", "",
              "| devices | m | k | n | a transposed | Triton GPU ms | Triton GPU TFLOP/s | addmm GPU ms "
              "| addmm GPU TFLOP/s | Triton speedup, GPU time | Triton call ms | addmm call ms "
              "| Triton speedup, call time | results agree | Triton tile (autotuned) | used by |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['devices']} | {r['m']} | {r['k']} | {r['n']} | {'yes' if r['a_transposed'] else 'no'} | "
              f"{r['triton_gpu_s'] * 1e3:.3f} | {r['triton_gpu_tflops']:.1f} | {r['addmm_gpu_s'] * 1e3:.3f} | "
              f"{r['addmm_gpu_tflops']:.1f} | {r['triton_over_addmm_gpu']:.2f}x | {r['triton_s'] * 1e3:.3f} | "
              f"{r['addmm_s'] * 1e3:.3f} | {r['triton_over_addmm']:.2f}x | {'yes' if r['agree'] else 'NO'} | "
              f"{r.get('triton_tile', '')} | "
              f"{'; '.join(r['uses'])} |" for r in rows]
    gpu = statistics.geometric_mean([r["triton_over_addmm_gpu"] for r in rows])
    call = statistics.geometric_mean([r["triton_over_addmm"] for r in rows])
    lines += ["", f"Geo-mean Triton speedup over addmm: {gpu:.2f}x in GPU time, {call:.2f}x in call time, over "
              f"{len(rows)} shapes."]
    return "\n".join(lines) + "\n"


@verb
def main_kernel(argv: list[str], machine_line, write_section) -> int:
    ap = Parser("python -m stpc bench kernel", __doc__)
    add_flags(ap, {"model": {"default": "llama2-7b", "zoo": True}, "batch": {"default": 8}, "seq": {"default": 2048},
                   "dtype": {"default": "bf16"}, "json": {"shown": "none", "note": "one record per shape"}})
    ap.add_argument("--sizes", nargs="+", type=int, default=list(DEFAULT_SIZES), metavar="N",
                    help="device counts, each the size of the ring (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls per shape and side (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=50,
                    help="timed calls (and CUDA graph replays) per shape and side (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph for the GPU time (default: %(default)s)")
    ap.add_argument("--results", help="regenerate this markdown file's kernel section (e.g. benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    if min(args.sizes) < 1 or args.warmup < 0 or args.iters < 1 or args.reps < 1:
        ap.error("--sizes, --iters and --reps must be at least 1, --warmup at least 0. Fix: give e.g. --sizes 4 8")
    cfg = {k: getattr(args, k) for k in ("model", "sizes", "batch", "seq", "dtype", "warmup", "iters", "reps")}
    shapes = ring_step_shapes(args.model, args.sizes, args.batch, args.seq)
    reason = why_not_measured()
    rows = shapes if reason else [measure(s, TORCH_DTYPES[args.dtype], args.warmup, args.iters, args.reps)
                                     for s in shapes]
    command = ("python -m stpc bench kernel " + " ".join(argv)).strip()
    text = report(cfg, rows, reason, machine_line(), command)
    if args.quiet:
        print(f"not measured: {reason}" if reason else text.rstrip("\n").splitlines()[-1])
    else:
        print(text)
    if args.json:
        write_json(args.json, {"config": cfg, "measured": reason is None, "not_measured_because": reason,
                               "shapes": rows})
    if args.results:
        write_section(args.results, "kernel", text)
    return 0


__all__ = ["main_kernel", "ring_step_shapes", "step_gemms", "layer_linears", "measure", "report", "cuda_graph_median_s"]
