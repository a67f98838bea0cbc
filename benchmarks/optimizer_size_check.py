"""How fast AdamW's step streams its state, by the number of elements a rank steps.

    .venv/bin/python benchmarks/optimizer_size_check.py [--ranks 4] [--impl fused]
                                                        [--numels 3150000,6300000,...]

``calibrate``'s optimizer probe (``stpc.cli.calibrate._optimizer_step``) times one AdamW step
and divides it by the roofline of the bytes the step moves; the planner charges every plan's
step at that slowdown. The figure holds only where the probe's state streams from memory as
a training step's does. This script times the step over several sizes, every rank at once,
with the probe's own timing (``_sustained``: calls kept busy over a window right after a
barrier) and prints the rate per size, the slowest rank's: where the rate drops, the state of
all ranks has outgrown the cache, and the probe's size must lie past that point (on the
development VM a quarter of the fidelity GPT's layer, 3.15M elements a rank, did not).
"""
from __future__ import annotations

import argparse
import sys

import torch

from stpc.cli.calibrate import OPTIMIZER_WINDOW_S, _sustained
from stpc.cost_models.compute import optimizer_step_bytes
from stpc.runtime.launch import spawn

NUMELS = (3_150_000, 6_300_000, 12_600_000, 25_200_000, 50_400_000)
PIECES = 4  # each size stepped as this many equal tensors (a layer's few large weights)


def _worker(rank: int, world: int, numels: list[int], impl: str, window_s: float) -> dict[int, float]:
    dev = torch.device("cpu")
    out = {}
    for n in numels:
        params = [torch.nn.Parameter(torch.randn(n // PIECES)) for _ in range(PIECES)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
        opt.step()  # its state made
        out[n] = _sustained(opt.step, dev, window_s)
        del params, opt
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--impl", choices=("fused", "foreach"), default="fused")
    ap.add_argument("--numels", default=",".join(map(str, NUMELS)),
                    help="elements a rank steps, comma-separated (each a multiple of %d)" % PIECES)
    ap.add_argument("--window", type=float, default=OPTIMIZER_WINDOW_S, help="seconds each size is timed over")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    numels = [int(x) for x in args.numels.split(",")]
    if any(n <= 0 or n % PIECES for n in numels):
        raise SystemExit(f"--numels: each must be a positive multiple of {PIECES}, got {numels}")
    per_rank = spawn(_worker, args.ranks, numels, args.impl, args.window, timeout_s=args.timeout)
    per_elem = optimizer_step_bytes("fp32-adam", args.impl)
    print(f"AdamW ({args.impl}, {per_elem:.0f} B moved an element) on {args.ranks} ranks at once, the slowest rank:")
    print("| elements a rank | state of all ranks MiB | step ms | GB/s of the bytes it moves |")
    print("|---|---|---|---|")
    for n in numels:
        secs = max(r[n] for r in per_rank)
        print(f"| {n} | {args.ranks * n * 16 / 2**20:.0f} | {secs * 1e3:.3f} | {n * per_elem / secs / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
