"""The ranks' skew at a blocking collective, against the compute since they last met.

    .venv/bin/python benchmarks/skew_check.py [--ranks 4] [--rounds 15] [--blocks 1,2,4,16]
                                              [--cluster PROFILE] [--json FILE]
                                              [--results benchmarks/RESULTS.md]

The cost model charges a collective every rank waits on where it runs (an activation's
reshard) its own time plus the ranks' skew in reaching it: ``Cluster.collective_sync_s``,
which ``calibrate`` measures after one block of GEMMs, and ``Cluster.ring_sync_s`` where the
transfer runs right after a P(2^k x 2^k) op's backward, the ranks having met at its last
exchange (``CostModel.blocking``). This script measures the skew after several lengths of
compute, and (on 4 ranks) after a P(2x2) op against the same GEMMs as a plain block, and
after a LayerNorm kept in the grid layout (``runtime.grid_layer_norm``), whose statistics
every rank all-gathers before it normalises its block: how the skew depends on the compute
since the ranks met, which the model's figures stand for (a reshard right after such a norm
is charged the square-root law of the norm's own compute, ``CostModel.blocking``'s
``since_meeting_s``).

Each case, every rank at once from a barrier, ``REPS`` calls a window, in interleaved
rounds (one window of every part a round): the compute alone, the collective alone (a
4 MiB all-reduce, ``calibrate``'s), and the compute followed by the collective. A round's
skew is the pair less the compute alone as the typical rank (the median over ranks) ran it
and less the collective alone (each pair and collective the slowest rank's, as they end
when their slowest member does), ``calibrate``'s reading of its blocking probe; the
median over rounds is reported, with the square-root law through the profile's figure
(``collective_sync_s * sqrt(compute / its probe's compute)``) beside it.

Writes the ``skew`` section of ``--results`` (between its markers, replaced whole).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

import stpc
from stpc.cli.bench import machine_line, write_section
from stpc.cli.calibrate import OVERLAP_LONG, SYNC_BYTES
from stpc.cost_models import CostModel, get_cluster
from stpc.cost_models.profile import read_profile
from stpc.planner.costs import NodeTimer
from stpc.planner.strategies import enumerate_strategies
from stpc.runtime.launch import spawn
from stpc.runtime.grid_norm import grid_layer_norm
from stpc.runtime.ops import primepar_linear

BLOCKS = (1, 2, 4, 16)        # GEMMs of OVERLAP_LONG's shape before the collective (--blocks)
# The P(2x2) op's blocks: the fidelity bench GPT's q/k/v projection on 4 ranks (2048 tokens,
# d 1024): x [1024, 512] and w [512, 512] per rank, two steps of one 1024 x 512 x 512 GEMM.
P2X2_BLOCKS = ((1024, 512), (512, 512))
# The grid LayerNorm's block: the same GPT's norm input on 4 ranks, [2048, 1024] split over
# the 2x2 grid's rows and columns (B0.1 on the axis of 4)
GRID_NORM_BLOCK = (1024, 512)
GRID_NORM_CASE = "grid LayerNorm (statistics all-gathered)"
REPS = 3


def _window(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    return (time.perf_counter() - t0) / REPS


def _worker(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    x, w = torch.randn(OVERLAP_LONG[:2]), torch.randn(OVERLAP_LONG[1:])
    small = torch.ones(SYNC_BYTES // 4)

    def block(k):
        def run():
            for _ in range(k):
                torch.mm(x, w)
        return run

    def collective():
        dist.all_reduce(small)

    cases = {f"{k} GEMM{'s' if k > 1 else ''}": block(k) for k in cfg["blocks"]}
    if world == 4:
        px, pw = torch.randn(P2X2_BLOCKS[0]), torch.randn(P2X2_BLOCKS[1])
        cases["P(2x2) op, 2 steps"] = lambda: primepar_linear(px, pw, dist.group.WORLD, 1)
        cases["its 2 GEMMs as a block"] = lambda: (torch.mm(px, pw), torch.mm(px, pw))
        nx = torch.randn(GRID_NORM_BLOCK)
        nw, nb = torch.ones(GRID_NORM_BLOCK[1] * 2), torch.zeros(GRID_NORM_BLOCK[1] * 2)
        world_name = dist.group.WORLD.group_name
        cases[GRID_NORM_CASE] = lambda: grid_layer_norm(nx, nw, nb, 1e-5, world_name)
    out = {name: {"compute": [], "collective": [], "both": []} for name in cases}
    for r in range(cfg["rounds"] + 1):          # (round 0 warms up)
        for name, fn in cases.items():
            parts = (_window(fn), _window(collective), _window(lambda: (fn(), collective())))
            if r:
                for key, t in zip(("compute", "collective", "both"), parts):
                    out[name][key].append(t)
    got = [None] * world
    dist.all_gather_object(got, out)
    return {"per_rank": got} if rank == 0 else {}


def skew_rows(per_rank: list[dict]) -> list[dict]:
    """Per case: the typical rank's compute (median over rounds of the median over ranks)
    and the skew (median over rounds of both - typical compute - collective, the pair and
    the collective the slowest rank's), with its rounds' range."""
    rows = []
    for name in per_rank[0]:
        n = len(per_rank[0][name]["compute"])
        typical = [statistics.median(p[name]["compute"][i] for p in per_rank) for i in range(n)]
        skews = [max(p[name]["both"][i] for p in per_rank) - typical[i] - max(p[name]["collective"][i] for p in per_rank)
                 for i in range(n)]
        rows.append({"case": name, "compute_s": statistics.median(typical), "skew_s": statistics.median(skews),
                     "min_s": min(skews), "max_s": max(skews), "rounds": n})
    return rows


def grid_norm_tail_s(cluster: str, ranks: int = 4) -> float | None:
    """The compute the planner charges a grid LayerNorm of this script's block after its
    statistics' exchange (``NodeTimer.meeting_tail``: its forward compute; the whole tensor,
    ``GRID_NORM_BLOCK`` times the grid's side in each dim, in B layout on an axis of
    ``ranks``), on ``cluster``'s cost model; None where the planner gives that layout no
    such compute."""
    rows, width = GRID_NORM_BLOCK
    q = int(ranks ** 0.5)
    with torch.device("meta"):
        tg = stpc.trace(torch.nn.LayerNorm(width * q), (torch.empty(rows * q, width * q),))
    ln = next(n for n in tg.gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default)
    cm = CostModel(get_cluster(cluster), (ranks,))
    for s in enumerate_strategies(ln, (ranks,))[0]:
        if s.out[0][0] == "B":
            tail = NodeTimer(ln, cm, [True, True, True]).meeting_tail(s)
            return None if tail is None else tail[0]
    return None


def report(cfg: dict, rows: list[dict], profile: dict | None, machine: str, command: str,
           norm_tail_s: float | None = None) -> str:
    ov = (profile or {}).get("overlap", {})
    sync, ref = ov.get("collective_sync_s"), ov.get("blocking", {}).get("gemms_typical_s")
    ring_sync = ov.get("ring_sync_s")
    rows_, n, k = OVERLAP_LONG
    lines = ["## The ranks' skew at a blocking collective, against the compute since they met (issue 12)", "",
             f"Command: `{command}`", "", machine, "",
             f"{cfg['ranks']} gloo ranks (one intra-op thread each), {cfg['rounds']} interleaved rounds after one "
             f"warm-up, {REPS} calls a window. Before a {SYNC_BYTES >> 20} MiB all-reduce: blocks of {rows_} x {n} x "
             f"{k} fp32 GEMMs (`calibrate`'s probe shape), and a P(2x2) op (`stpc::primepar_linear`, forward, x "
             f"{list(P2X2_BLOCKS[0])} and w {list(P2X2_BLOCKS[1])} per rank: the fidelity GPT's q/k/v on 4 ranks; "
             f"its last step computes after the ranks' last exchange) against its two GEMMs as a plain block"
             + (f", and a LayerNorm kept in the grid layout (`runtime.grid_layer_norm`, x {list(GRID_NORM_BLOCK)} per "
                f"rank: the same GPT's norm input; the ranks meet at its statistics' exchange, then it normalises)"
                if any(r["case"] == GRID_NORM_CASE for r in rows) else "") + ". "
             f"Skew: the compute followed by the all-reduce, less the compute alone as the typical rank (the "
             f"median over ranks) ran it, less the all-reduce alone; the median over rounds. The square-root "
             f"column: the profile's `collective_sync_s` scaled by the square root of the compute over its "
             f"probe's compute (`{cfg['cluster']}`"
             + (f": {sync * 1e3:.2f} ms after {ref * 1e3:.1f} ms" if sync is not None and ref else ": none") + ").", "",
             "| before the all-reduce | typical rank's compute ms | skew ms (median) | rounds min .. max ms | "
             "square-root law through the profile's figure ms |",
             "|---|---|---|---|---|"]
    for r in rows:
        since = norm_tail_s if r["case"] == GRID_NORM_CASE else r["compute_s"]
        law = f"{sync * math.sqrt(since / ref) * 1e3:.1f}" if sync is not None and ref and since is not None else "-"
        lines.append(f"| {r['case']} | {r['compute_s'] * 1e3:.1f} | {r['skew_s'] * 1e3:.2f} | "
                     f"{r['min_s'] * 1e3:.1f} .. {r['max_s'] * 1e3:.1f} | {law} |")
    by = {r["case"]: r for r in rows}
    if "P(2x2) op, 2 steps" in by:
        op, blk = by["P(2x2) op, 2 steps"], by["its 2 GEMMs as a block"]
        lines += ["", f"After the P(2x2) op the skew was {op['skew_s'] * 1e3:.2f} ms, after its GEMMs as a plain "
                  f"block {blk['skew_s'] * 1e3:.2f} ms"
                  + (f"; the profile's `ring_sync_s`, what the model charges a transfer right after a P(2^k x 2^k) "
                     f"op's backward, is {ring_sync * 1e3:.2f} ms (`calibrate`'s after-ring probe: an AG ring of its "
                     f"probe blocks, four steps, then the all-reduce)" if ring_sync is not None else "") + "."]
    if GRID_NORM_CASE in by:
        norm = by[GRID_NORM_CASE]
        lines += ["", f"After the grid LayerNorm (`runtime.grid_layer_norm` on a block of {list(GRID_NORM_BLOCK)} per "
                  f"rank: its statistics all-gathered over the ranks, every rank waiting there, then its block "
                  f"normalised; its {norm['compute_s'] * 1e3:.1f} ms hold that exchange) the skew was "
                  f"{norm['skew_s'] * 1e3:.2f} ms"
                  + (f". The model charges a reshard of such a norm's output (its skew into a P(2x2) linear's input) "
                     f"the square-root law of the norm's forward compute as the planner models it "
                     f"({norm_tail_s * 1e3:.2f} ms, `NodeTimer.meeting_tail`): its row's last column, not the "
                     f"stretch's {sync * 1e3:.2f} ms" if norm_tail_s is not None and sync is not None
                     else "") + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--blocks", default=",".join(map(str, BLOCKS)),
                    help="GEMMs before the collective, comma-separated (default: %(default)s)")
    ap.add_argument("--cluster", default="benchmarks/data/calibration_cpu_vm_s66.json",
                    help="the calibration profile whose figures the table sets beside the measurement")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json")
    ap.add_argument("--results", help="write the skew section of this markdown file (benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    cfg = {"ranks": args.ranks, "rounds": args.rounds, "cluster": args.cluster,
           "blocks": [int(k) for k in args.blocks.split(",") if k.strip()]}
    profile = read_profile(args.cluster) if args.cluster else None
    res = spawn(_worker, args.ranks, cfg, timeout_s=args.timeout)[0]
    rows = skew_rows(res["per_rank"])
    command = "python benchmarks/skew_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    tail = grid_norm_tail_s(args.cluster, args.ranks) if args.cluster and args.ranks == 4 else None
    text = report(cfg, rows, profile, machine_line(), command.strip(), tail)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, **res}, f, indent=1)
    if args.results:
        write_section(args.results, "skew", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
