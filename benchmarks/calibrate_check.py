"""Calibrate on local gloo ranks, then check the cost model against fresh measurements.

    .venv/bin/python benchmarks/calibrate_check.py [--ranks 4] [--out /tmp/stpc_profile.json]

Calibration uses the default grid (64 KiB .. 64 MiB, powers of 4); the check sizes lie
*between* grid points so the comparison tests the fitted model, not a lookup. Prints a
markdown table: the banded (piecewise alpha-beta) prediction the CostModel makes, the
single least-squares line, and the freshly measured time.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

from stpc.cli.calibrate import calibrate, measure_collectives
from stpc.cost_models import CostModel, get_cluster
from stpc.cost_models.profile import predict

CHECK_SIZES = [384 << 10, 6 << 20, 48 << 20]
CHECK_KINDS = ("all_gather", "reduce_scatter", "p2p", "all_reduce", "all_to_all")


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def run(ranks: int, out: str) -> list[dict]:
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    prof = calibrate(ranks, out)
    t_cal = time.perf_counter() - t0
    cm = CostModel(get_cluster(out), (ranks,))
    fresh = measure_collectives(ranks, CHECK_SIZES, CHECK_KINDS)
    rows = []
    for kind, nbytes, measured in fresh:
        pred = getattr(cm, kind)(nbytes, 0)
        c = prof["collectives"][kind]
        line = predict(kind, ranks, nbytes, c["alpha_s"], c["bw_bytes_per_s"])
        rows.append({"kind": kind, "nbytes": nbytes, "measured": measured, "predicted": pred,
                     "err": pred / measured - 1, "line": line, "line_err": line / measured - 1})
    load_after = os.getloadavg()
    print(f"calibration: {ranks} {prof['backend']} ranks on {platform.node()} ({os.cpu_count()} cores), "
          f"{t_cal:.0f} s, profile {out}; 1-min load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after (other jobs share these cores)\n")
    print("| collective | size | measured (ms) | predicted, banded (ms) | error | single α-β line (ms) | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {_fmt_size(r['nbytes'])} | {r['measured'] * 1e3:.2f} | "
              f"{r['predicted'] * 1e3:.2f} | {r['err']:+.0%} | {r['line'] * 1e3:.2f} | {r['line_err']:+.0%} |")
    print("\nfitted single-line α-β per collective:\n")
    print("| collective | α (µs) | bandwidth (GB/s) | rms rel. error of the line on the calibration grid |")
    print("|---|---|---|---|")
    for kind, c in prof["collectives"].items():
        print(f"| {kind} | {c['alpha_s'] * 1e6:.0f} | {c['bw_bytes_per_s'] / 1e9:.3f} | {c['rel_rms']:.0%} |")
    gated = [r for r in rows if r["kind"] in ("all_gather", "reduce_scatter", "p2p")]
    worst = max(abs(r["err"]) for r in gated)
    print(f"\nworst |error| over all-gather, reduce-scatter, P2P (banded model): {worst:.0%} (target 30%)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "stpc_profile.json"))
    args = ap.parse_args(argv)
    run(args.ranks, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
