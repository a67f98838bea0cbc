"""The GEMM efficiency curve the planner assumes, held against the device's own matmuls:

    python benchmarks/gemm_curve_check.py [--spec h200] [--dtype bf16] [--models M ...]
                                          [--tokens T ...] [--shards S ...] [--json FILE] [--markdown FILE]

The planner times a matmul of ``f`` FLOPs as ``f / (peak * efficiency) + ramp``
(``cost_models.compute.gemm_time``, memory-bound where its bytes say so). On the GPU presets
both terms are named guesses (``cost_models.devices``): ``GEMM_EFFICIENCY`` = 0.75 (cuBLAS's
share of peak on a large bf16 GEMM, "70-80% on A100/H100") and the wave-quantization ramp
(``wave_ramp_s``: half a wave of 256x128 tiles at K = 4096). This times the GEMMs that
PrimePar's cells run on one device (the primepar bench: global batch 8 x seq 2048 = 16384
tokens): each model's up (d -> ffn) and down (ffn -> d) linears with the tokens split over
``--tokens`` and the weight split over ``--shards`` (tensor, ring or grid parallelism), in
their forward, input-gradient and weight-gradient shapes; prints each beside the model's
time; then fits the same curve to the measurements (``cost_models.fit_gemm_curve``, what
``python -m stpc calibrate`` fits on its ranks) and reports it beside the preset's.

Timing: the device's own clock (CUDA events on a GPU), ``torch.mm`` into a fresh output as a
linear's matmul runs, warmed up, the median of ``--windows`` windows of at least
``--window-ms``. ``--json`` keeps every row; ``--markdown`` writes the RESULTS.md section.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from stpc.cost_models import canonical_dtype, fit_gemm_curve, gemm_time, get_device
from stpc.frontend.models import get_config

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = ("llama2-7b", "llama2-70b", "opt-175b")
TOKENS = (16384, 4096, 1024)   # the primepar cells' 16384 tokens over 1, 4, 16 data shards
SHARDS = (1, 4, 16)            # a linear's weight over 1, 4, 16 devices


def gemm_shapes(models=MODELS, tokens=TOKENS, shards=SHARDS) -> list[dict]:
    """One row per GEMM: ``(m, k) @ (k, n)`` with the linear, phase and split it comes from.
    A linear ``x [T, i] @ w [i, o]`` runs forward ``(T, i) @ (i, o)``, input-gradient
    ``(T, o) @ (o, i)`` and weight-gradient ``(i, T) @ (T, o)``; the weight's split cuts ``o``
    of the up projection (column parallel) and ``i`` of the down projection (row parallel)."""
    rows = []
    for name in models:
        cfg = get_config(name)
        d, ffn = cfg.d_model, cfg.ffn
        for t in tokens:
            for s in shards:
                for linear, (i, o) in (("up", (d, ffn // s)), ("down", (ffn // s, d))):
                    for phase, (m, k, n) in (("fwd", (t, i, o)), ("dgrad", (t, o, i)), ("wgrad", (i, t, o))):
                        rows.append({"model": name, "linear": linear, "tokens": t, "shards": s,
                                     "phase": phase, "m": m, "k": k, "n": n})
    return rows


class _Clock:
    """Elapsed seconds of a callable's calls on the device's own clock."""

    def __init__(self, dev: torch.device):
        self.dev = dev

    def __call__(self, fn, reps: int) -> float:
        if self.dev.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return time.perf_counter() - t0


def time_gemm(m: int, k: int, n: int, dtype: str, dev: torch.device, window_s: float, windows: int) -> float:
    """Median seconds of one ``torch.mm`` of ``(m, k) @ (k, n)`` in ``dtype`` on ``dev``."""
    a = torch.randn(m, k, device=dev, dtype=TORCH_DTYPES[dtype])
    b = torch.randn(k, n, device=dev, dtype=TORCH_DTYPES[dtype])
    clock = _Clock(dev)
    fn = lambda: torch.mm(a, b)  # noqa: E731  (a fresh output per call, as a linear's)
    clock(fn, 3)                 # warm-up: cuBLAS's heuristics and workspace
    one = max(clock(fn, 1), 1e-7)
    reps = max(1, int(window_s / one))
    return statistics.median(clock(fn, reps) / reps for _ in range(windows))


def measure(rows: list[dict], dtype: str, dev: torch.device, spec, window_s: float = 0.02, windows: int = 5,
            progress=None) -> list[dict]:
    """Each row timed on ``dev`` and beside ``spec``'s modelled time (``gemm_time``)."""
    size = torch.finfo(TORCH_DTYPES[dtype]).bits // 8
    out = []
    for r in rows:
        m, k, n = r["m"], r["k"], r["n"]
        flops = 2.0 * m * k * n
        sec = time_gemm(m, k, n, dtype, dev, window_s, windows)
        model = gemm_time(spec, flops, size * (m * k + k * n + m * n), dtype)
        rec = {**r, "dtype": dtype, "flops": flops, "seconds": sec, "model_s": model,
               "error": model / sec - 1, "tflops": flops / sec / 1e12}
        out.append(rec)
        if progress:
            progress(rec)
    return out


def curves(rows: list[dict], spec, dtype: str) -> dict:
    """The preset's curve and the one fitted to ``rows`` (rate as a share of the preset's peak)."""
    peak = spec.peak_flops[canonical_dtype(dtype)]
    rate, ramp = fit_gemm_curve(rows)
    fitted = [(r["flops"] / rate + ramp) / r["seconds"] - 1 for r in rows]
    return {"peak_flops": peak,
            "preset": {"efficiency": spec.efficiency, "ramp_s": spec.ramp_s(dtype)},
            "fitted": {"efficiency": rate / peak, "ramp_s": ramp},
            "preset_error": _spread([r["error"] for r in rows]),
            "fitted_error": _spread(fitted)}


def merge(docs: list[dict]) -> dict:
    """Several runs' JSON as one (same device, preset and dtype): their rows together and the
    curves refitted over them all."""
    first = docs[0]
    for d in docs[1:]:
        if (d["device"], d["spec"], d["dtype"]) != (first["device"], first["spec"], first["dtype"]):
            raise ValueError(f"cannot merge a run on {d['device']} ({d['spec']}, {d['dtype']}) with one on "
                             f"{first['device']} ({first['spec']}, {first['dtype']})")
        if d["curves"]["preset"] != first["curves"]["preset"]:
            raise ValueError("cannot merge runs made under different presets: their errors are not one model's")
    if len(docs) == 1:
        return first
    rows = [r for d in docs for r in d["rows"]]
    # the preset as it was when measured (the rows' errors are its), not as it is now
    fitted = curves(rows, get_device(first["spec"]), first["dtype"])
    fitted["preset"] = first["curves"]["preset"]
    return {**first, "command": "`; `".join(d["command"] for d in docs), "date": ", ".join(d["date"] for d in docs),
            "rows": rows, "curves": fitted}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _spread(errors: list[float]) -> dict:
    return {"median": statistics.median(errors), "min": min(errors), "max": max(errors),
            "median_abs": statistics.median(abs(e) for e in errors)}


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def markdown(doc: dict) -> str:
    """The RESULTS.md section of one run's JSON."""
    rows, c = doc["rows"], doc["curves"]
    spec, dt = doc["spec"], doc["dtype"]
    lines = ["## GEMM efficiency curve: the preset against the device's matmuls (benchmarks/gemm_curve_check.py)",
             "", f"Command{'s' if '`; `' in doc['command'] else ''}: `{doc['command']}`", "", f"{doc['device']}, torch {doc['torch']}; {doc['date']}. "
             f"Preset `{spec}` ({dt}, peak {c['peak_flops'] / 1e12:.1f} TFLOP/s dense). Error = modelled / measured - 1.",
             "", "| curve | efficiency (of peak) | ramp us | error median | min | max | median abs |",
             "|---|---|---|---|---|---|---|"]
    for name in ("preset", "fitted"):
        e = c[f"{name}_error"]
        label = "the preset when measured" if name == "preset" else "fitted to these rows (in-sample)"
        lines.append(f"| {label} | {c[name]['efficiency']:.3f} | {c[name]['ramp_s'] * 1e6:.1f} | "
                     f"{_pct(e['median'])} | {_pct(e['min'])} | {_pct(e['max'])} | {e['median_abs'] * 100:.1f}% |")
    lines += ["", "By phase and size (the preset's error; measured TFLOP/s, median over the group):", "",
              "| phase | GFLOP per GEMM | GEMMs | measured TFLOP/s | preset error median | min | max |",
              "|---|---|---|---|---|---|---|"]
    bands = [(0, 1e10), (1e10, 1e11), (1e11, 1e12), (1e12, float("inf"))]
    for phase in ("fwd", "dgrad", "wgrad"):
        for lo, hi in bands:
            g = [r for r in rows if r["phase"] == phase and lo <= r["flops"] < hi]
            if not g:
                continue
            span = f"{lo / 1e9:g}-{hi / 1e9:g}" if hi != float("inf") else f">= {lo / 1e9:g}"
            es = [r["error"] for r in g]
            lines.append(f"| {phase} | {span} | {len(g)} | {statistics.median(r['tflops'] for r in g):.3g} | "
                         f"{_pct(statistics.median(es))} | {_pct(min(es))} | {_pct(max(es))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="h200", help="the device preset to hold against (default: %(default)s)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--shards", nargs="+", type=int, default=list(SHARDS))
    ap.add_argument("--window-ms", type=float, default=20.0)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--from-json", nargs="+", metavar="FILE", help="render --markdown from earlier runs' --json, "
                    "running nothing (several: their rows together, one curve fitted to them all)")
    args = ap.parse_args()
    if args.from_json:
        doc = merge([_load(p) for p in args.from_json])
    else:
        dev = torch.device(args.device)
        if dev.type == "cuda":  # the planner's bf16/fp16 GEMMs; fp32 without TF32 is the fp32 figure
            torch.backends.cuda.matmul.allow_tf32 = False
        spec = get_device(args.spec)
        rows = measure(gemm_shapes(args.models, args.tokens, args.shards), args.dtype, dev, spec,
                       args.window_ms / 1e3, args.windows,
                       progress=lambda r: print(json.dumps({k: r[k] for k in ("model", "linear", "tokens", "shards",
                                                                             "phase", "tflops", "error")}), flush=True))
        doc = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU", "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "spec": spec.name, "dtype": args.dtype,
               "command": "python benchmarks/gemm_curve_check.py " + " ".join(sys.argv[1:]),
               "rows": rows, "curves": curves(rows, spec, args.dtype)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    text = markdown(doc)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
