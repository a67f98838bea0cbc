"""stpc's ring ops against torch's fused collective matmuls, on the ranks this machine has
(issue 17: "on a CUDA GPU, the same for the ops that one device can run"):

    python benchmarks/fused_ops_check.py [--ranks N] [--model llama2-7b] [--tokens 16384]
                                         [--dtype bf16] [--json FILE] [--markdown FILE]

For each linear Megatron splits in one layer of ``--model`` (column-parallel ones as an
all-gather before the matmul, row-parallel ones as a reduce-scatter after it), over a
group of ``--ranks`` ranks holding ``--tokens`` tokens in all:

* ``unfused``: torch's functional collective, waited, then the matmul (or the matmul, then
  the collective): what a plain tensor-parallel program runs;
* ``stpc ring``: ``stpc.runtime.ops.ring_allgather_matmul`` /
  ``ring_matmul_reducescatter`` (P2P ring steps beside each step's GEMM; on CUDA each step's
  GEMM by cuBLAS, the default), and again with the Triton ring-step kernel
  (``set_ring_kernel("triton")``) where Triton and CUDA are there;
* ``torch fused``: ``torch.distributed._symmetric_memory._fused_all_gather_matmul`` /
  ``_fused_matmul_reduce_scatter`` (micro-pipelined over symmetric memory), where the
  group can set symmetric memory up (CUDA); elsewhere the row says why it did not run.

Each result is checked against the unfused one (rtol/atol for the dtype), and each time is
the median of ``--iters`` calls after ``--warmup`` (CUDA events on a GPU; on CPU ranks the
slowest rank's wall clock from a barrier). NCCL with one rank per GPU where the machine
has the GPUs, else gloo on CPU. With one rank the collectives move nothing: the table is
then each op's cost over one device's matmul, not a communication measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from stpc.cli._common import TORCH_DTYPES  # noqa: E402
from stpc.cli.bench_kernel import cuda_median_s, layer_linears  # noqa: E402
from stpc.runtime.launch import spawn  # noqa: E402
from stpc.runtime.ops import kernels  # noqa: E402
from stpc.runtime.ops.ring import ring_allgather_matmul, ring_matmul_reducescatter  # noqa: E402

# (renamed in torch 2.13; the GPU machines run older wheels)
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
TOLERANCE = {"fp32": (1e-4, 1e-4), "bf16": (2e-2, 2e-2), "fp16": (1e-2, 1e-2)}


def op_shapes(model: str, ranks: int, tokens: int) -> list[dict]:
    """One row per distinct (ring, d_in, d_out) of ``model``'s first layer: this rank's
    operands (x shard, w shard) of the all-gather or reduce-scatter form."""
    seen: dict = {}
    for name, d_in, d_out, ring in layer_linears(model):
        if tokens % ranks or (d_out if ring == "ag_ring" else d_in) % ranks:
            raise ValueError(f"{name}: {tokens} tokens and its split dim must divide over {ranks} ranks")
        key = (ring, d_in, d_out)
        if key in seen:
            seen[key]["linears"].append(name)
            continue
        if ring == "ag_ring":  # x: [T/P, d_in] gathered on rows; w: [d_in, d_out/P]
            x, w = (tokens // ranks, d_in), (d_in, d_out // ranks)
        else:                  # x: [T, d_in/P]; w: [d_in/P, d_out]; output rows scattered
            x, w = (tokens, d_in // ranks), (d_in // ranks, d_out)
        seen[key] = {"op": "all_gather + matmul" if ring == "ag_ring" else "matmul + reduce_scatter",
                     "x": list(x), "w": list(w), "linears": [name]}
    return list(seen.values())


def _timer(dev: torch.device):
    if dev.type == "cuda":
        median_s = cuda_median_s
    else:
        def median_s(fn, warmup, iters):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

    def slowest(fn, warmup, iters):
        t = torch.tensor([median_s(fn, warmup, iters)], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
        return float(t.item())
    return slowest


def _torch_fused(kind: str, x, w, group_name: str):
    """A closure running torch's fused op, or the reason it cannot run here."""
    if x.device.type != "cuda":
        return None, "symmetric memory needs CUDA tensors"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        if kind == "ag_ring":
            fn = lambda: symm_mem._fused_all_gather_matmul(x, [w], 0, group_name)[1][0]  # noqa: E731
        else:
            fn = lambda: symm_mem._fused_matmul_reduce_scatter(x, w, "sum", 0, group_name)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        return fn, None
    except Exception as exc:  # (the group cannot set symmetric memory up: say why, measure the rest)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _worker(rank: int, world: int, cfg: dict) -> list[dict] | None:
    dev = torch.device("cuda", torch.cuda.current_device()) if cfg["backend"] == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    dtype = TORCH_DTYPES[cfg["dtype"]]
    rtol, atol = TOLERANCE[cfg["dtype"]]
    group = dist.group.WORLD
    group_name = group.group_name
    timed = _timer(dev)
    rows = []
    for shape in op_shapes(cfg["model"], world, cfg["tokens"]):
        ring = "ag_ring" if shape["op"].startswith("all_gather") else "rs_ring"
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(*shape["x"], generator=g, device=dev, dtype=dtype) / shape["x"][1] ** 0.5
        w = torch.randn(*shape["w"], generator=g, device=dev, dtype=dtype)
        if ring == "ag_ring":
            unfused = lambda: funcol.wait_tensor(_ALL_GATHER(x, 0, group)) @ w  # noqa: E731
            ours = lambda: ring_allgather_matmul(x, w, 0, group)  # noqa: E731
        else:
            unfused = lambda: funcol.wait_tensor(_REDUCE_SCATTER(x @ w, "sum", 0, group))  # noqa: E731
            ours = lambda: ring_matmul_reducescatter(x, w, 0, group)  # noqa: E731
        want = unfused().float()
        row = {**shape, "unfused_s": timed(unfused, cfg["warmup"], cfg["iters"])}
        variants = [("stpc_ring", ours, "cublas" if dev.type == "cuda" else None)]
        if dev.type == "cuda" and kernels.HAS_TRITON:
            variants.append(("stpc_ring_triton", ours, "triton"))
        fused, why = _torch_fused(ring, x, w, group_name)
        ran = torch.tensor([int(fused is not None)], device=dev)
        dist.all_reduce(ran, op=dist.ReduceOp.MIN)  # (every rank times it, or none: no rank left waiting)
        if fused is not None and not ran.item():
            fused, why = None, "symmetric memory could not be set up on every rank"
        if fused is not None:
            variants.append(("torch_fused", fused, None))
        else:
            row["torch_fused_not_run"] = why
        for key, fn, kernel in variants:
            if kernel is not None:
                kernels.set_ring_kernel(kernel)
            got = fn().float()
            ok = torch.tensor([int(bool(torch.allclose(got, want, rtol=rtol, atol=atol)))], device=dev)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            row[f"{key}_agrees"] = bool(ok.item())
            row[f"{key}_s"] = timed(fn, cfg["warmup"], cfg["iters"])
        kernels.set_ring_kernel("cublas")
        m = shape["x"][0] * (world if ring == "ag_ring" else 1)
        row["tflops_unfused"] = 2.0 * m * shape["x"][1] * shape["w"][1] / row["unfused_s"] / 1e12
        rows.append(row)
    return rows if rank == 0 else None


def run(cfg: dict) -> list[dict]:
    return spawn(_worker, cfg["ranks"], cfg, backend=cfg["backend"], timeout_s=cfg["timeout_s"])[0]


def machine_line(cfg: dict) -> str:
    if cfg["backend"] == "nccl":
        what = f"{torch.cuda.get_device_name(0)} x {cfg['ranks']} ({cfg['ranks']} NCCL rank(s), one per GPU)"
    else:
        what = f"{cfg['ranks']} gloo rank(s) on CPU ({os.cpu_count()} cores)"
    return f"{what}, torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"


def markdown(cfg: dict, rows: list[dict], command: str) -> str:
    variants = [k[:-2] for k in ("stpc_ring_s", "stpc_ring_triton_s", "torch_fused_s") if any(k in r for r in rows)]
    head = ["op", "linears", "x (this rank)", "w (this rank)", "unfused ms"] + [f"{v} ms" for v in variants] + \
           [f"{v} / unfused" for v in variants] + ["agree", "torch fused: not run"]
    out = [f"Command: `{command}`", "", machine_line(cfg), "",
           f"`{cfg['model']}`'s first layer, {cfg['tokens']} tokens over the group, {cfg['dtype']}; median of "
           f"{cfg['iters']} calls after {cfg['warmup']}, the slowest rank's. `x / unfused` < 1: faster than the "
           "collective then the matmul."
           + (" One rank: the collectives move nothing; each column is that op's cost over one device's matmul."
              if cfg["ranks"] == 1 else ""), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["op"], ", ".join(r["linears"]), "x".join(map(str, r["x"])), "x".join(map(str, r["w"])),
                 f"{r['unfused_s'] * 1e3:.3f}"]
        cells += [f"{r[v + '_s'] * 1e3:.3f}" if v + "_s" in r else "-" for v in variants]
        cells += [f"{r[v + '_s'] / r['unfused_s']:.2f}" if v + "_s" in r else "-" for v in variants]
        cells.append("yes" if all(r.get(v + "_agrees", True) for v in variants) else "NO")
        cells.append(r.get("torch_fused_not_run", "-"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=None, help="default: the GPUs (NCCL), else 2 CPU ranks (gloo)")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--dtype", choices=sorted(TOLERANCE), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = args.ranks or (gpus or 2)
    backend = "nccl" if gpus >= ranks else "gloo"
    cfg = {"ranks": ranks, "backend": backend, "model": args.model, "tokens": args.tokens,
           "dtype": args.dtype or ("bf16" if backend == "nccl" else "fp32"), "warmup": args.warmup,
           "iters": args.iters, "timeout_s": args.timeout}
    rows = run(cfg)
    command = "python benchmarks/fused_ops_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "machine": machine_line(cfg), "rows": rows}, f, indent=1)
    text = markdown(cfg, rows, command.strip())
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text)
    return 0 if all(r.get(k, True) for r in rows for k in r if k.endswith("_agrees")) else 1


if __name__ == "__main__":
    sys.exit(main())
