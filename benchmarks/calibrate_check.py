"""Calibrate on local gloo ranks, then check the cost model against fresh measurements.

    .venv/bin/python benchmarks/calibrate_check.py [--ranks 4] [--out /tmp/stpc_profile.json]

Calibration uses the default grid (``calibrate.DEFAULT_SIZES``: 64 KiB .. 64 MiB, powers of
4 and 24, 40 MiB); the check sizes lie *between* grid points so the comparison tests the
fitted model, not a lookup. Prints a markdown table: the banded (piecewise alpha-beta)
prediction the CostModel makes, the same bands fitted to the powers of 4 alone (the same
samples less the two between 16 and 64 MiB: what the denser grid changes), the single
least-squares line, and the freshly measured time.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import tempfile
import time

from stpc.cli.calibrate import DEFAULT_SIZES, calibrate, measure_collectives, refit_collectives, sampled_sizes
from stpc.cost_models import CostModel, get_cluster
from stpc.cost_models.profile import predict, save_profile

# Between grid points: 256 KiB-1 MiB, twice 4-16 MiB (6 and 12), then the three bands
# of 16-64 MiB.
CHECK_SIZES = [384 << 10, 6 << 20, 12 << 20, 20 << 20, 28 << 20, 48 << 20]
POWERS_OF_4 = [n for n in DEFAULT_SIZES if n & (n - 1) == 0 and n.bit_length() % 2 == 1]  # 2^(2k)
CHECK_KINDS = ("all_gather", "reduce_scatter", "p2p", "all_reduce", "all_to_all")


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def refit_on(profile: dict, sizes: list[int]) -> dict:
    """``profile`` with every collective entry fitted again to its samples at ``sizes`` only."""
    p = copy.deepcopy(profile)
    entries = list(p["collectives"].values()) + [e for kinds in p.get("group_collectives", {}).values()
                                                  for e in kinds.values()]
    for entry in entries:
        entry["samples"] = [s for s in entry["samples"] if int(s[0]) in sizes]
    refit_collectives(p)
    return p


def run(ranks: int, out: str) -> list[dict]:
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    prof = calibrate(ranks, out)
    t_cal = time.perf_counter() - t0
    cm = CostModel(get_cluster(out), (ranks,))
    sparse = os.path.join(tempfile.gettempdir(), os.path.basename(out).removesuffix(".json") + "_powers_of_4.json")
    save_profile(refit_on(prof, POWERS_OF_4), sparse)
    cm4 = CostModel(get_cluster(sparse), (ranks,))
    fresh = measure_collectives(ranks, CHECK_SIZES, CHECK_KINDS)
    rows = []
    for kind, nbytes, measured in fresh:
        pred = getattr(cm, kind)(nbytes, 0)
        c = prof["collectives"][kind]
        line = predict(kind, ranks, nbytes, c["alpha_s"], c["bw_bytes_per_s"])
        sparse_pred = getattr(cm4, kind)(nbytes, 0)
        rows.append({"kind": kind, "nbytes": nbytes, "measured": measured, "predicted": pred,
                     "err": pred / measured - 1, "sparse": sparse_pred, "sparse_err": sparse_pred / measured - 1,
                     "line": line, "line_err": line / measured - 1})
    load_after = os.getloadavg()
    print(f"calibration: {ranks} {prof['backend']} ranks on {platform.node()} ({os.cpu_count()} cores), "
          f"{t_cal:.0f} s, profile {out}; 1-min load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after (other jobs share these cores); grid "
          f"{', '.join(_fmt_size(n) for n in sampled_sizes(prof))}\n")
    print("| collective | size | measured (ms) | predicted, banded (ms) | error | banded on the powers of 4 alone (ms) "
          "| error | single α-β line (ms) | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {_fmt_size(r['nbytes'])} | {r['measured'] * 1e3:.2f} | "
              f"{r['predicted'] * 1e3:.2f} | {r['err']:+.0%} | {r['sparse'] * 1e3:.2f} | {r['sparse_err']:+.0%} | "
              f"{r['line'] * 1e3:.2f} | {r['line_err']:+.0%} |")
    print("\nfitted single-line α-β per collective:\n")
    print("| collective | α (µs) | bandwidth (GB/s) | rms rel. error of the line on the calibration grid |")
    print("|---|---|---|---|")
    for kind, c in prof["collectives"].items():
        print(f"| {kind} | {c['alpha_s'] * 1e6:.0f} | {c['bw_bytes_per_s'] / 1e9:.3f} | {c['rel_rms']:.0%} |")
    gated = [r for r in rows if r["kind"] in ("all_gather", "reduce_scatter", "p2p")]
    worst = max(abs(r["err"]) for r in gated)
    worst4 = max(abs(r["sparse_err"]) for r in gated)
    print(f"\nworst |error| over all-gather, reduce-scatter, P2P (banded model): {worst:.0%} (target 30%); "
          f"fitted to the powers of 4 alone: {worst4:.0%}")
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
