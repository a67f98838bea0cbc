"""What the compiled model's per-call signature check costs, against the all-gather it replaced.

    .venv/bin/python benchmarks/agreement_check.py [--ranks 4] [--rounds 25] [--json FILE]
                                                   [--results benchmarks/RESULTS.md]

Every call of a compiled model first compares its input signature across the ranks
(``Compiled._agree`` -> ``runtime.check_plan_agreement``): one all-reduce of two integers,
where until the sixty-fifth session it was an all-gather of a 32-byte digest. On gloo a
small collective's time depends on how many elements it carries against how many ranks
there are, so beside the two checks this times all-reduces of 1 .. ``2 * ranks`` float
elements and one of 65536.

Each case, every rank at once from a barrier, one call; the case's time in a round is the
slowest rank's (a collective ends when its slowest member does); rounds interleave the
cases, and the median over rounds is reported, with the process's CPU seconds (every
thread: gloo's too), the mean over ranks.

Writes the ``agreement`` section of ``--results`` (between its markers, replaced whole).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from stpc.cli.bench import machine_line, write_section
from stpc.runtime.agreement import check_plan_agreement
from stpc.runtime.launch import spawn

DIGEST = "ab" * 32  # a Plan.hash()'s width: 32 bytes


def cases(world: int) -> dict:
    """Name -> the call every rank makes in that case."""
    out = {"signature check (all-reduce of two integers)": lambda: check_plan_agreement(DIGEST),
           "the check it replaced (all-gather of 32 bytes)": lambda: dist.all_gather(
               [torch.empty(32, dtype=torch.uint8) for _ in range(world)], torch.ones(32, dtype=torch.uint8))}
    for n in sorted({*range(1, 2 * world + 1), 65536}):
        out[f"all-reduce of {n} float element{'' if n == 1 else 's'}"] = lambda n=n: dist.all_reduce(torch.ones(n))
    return out


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    fns = cases(world)
    times = {k: [] for k in fns}
    for r in range(cfg["rounds"] + 1):
        for j in range(len(fns)):
            name = list(fns)[(r + j) % len(fns)]
            dist.barrier()
            c0, t0 = _cpu(), time.perf_counter()
            fns[name]()
            t1, c1 = time.perf_counter(), _cpu()
            if r:  # (round 0: warm-up)
                times[name].append((t1 - t0, c1 - c0))
    return times


def rows(per_rank: list[dict]) -> list[dict]:
    """Per case: the median over rounds of the slowest rank's seconds, and of the ranks' mean
    CPU seconds."""
    out = []
    for name in per_rank[0]:
        rounds = list(zip(*[r[name] for r in per_rank]))
        out.append({"case": name, "wall_s": statistics.median(max(w for w, _ in rd) for rd in rounds),
                     "cpu_s": statistics.median(statistics.mean(c for _, c in rd) for rd in rounds),
                     "rounds": len(rounds)})
    return out


def report(cfg: dict, table: list[dict], machine: str, command: str) -> str:
    by = {r["case"]: r for r in table}
    new, old = (by[k]["wall_s"] for k in list(by)[:2])
    lines = ["## The per-call signature check (issue 17)", "", f"Command: `{command}`", "", machine, "",
             f"{cfg['ranks']} gloo ranks (one intra-op thread each), {cfg['rounds']} interleaved rounds after one "
             "warm-up, one call a case a round from a barrier; wall: the slowest rank's, CPU: the process's (every "
             "thread), the mean over ranks; medians over rounds.", "",
             "| case | wall ms | CPU ms |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['wall_s'] * 1e3:.2f} | {r['cpu_s'] * 1e3:.2f} |" for r in table]
    lines += ["", f"The signature check every call of a compiled model makes took {new * 1e3:.2f} ms, the all-gather "
              f"it replaced {old * 1e3:.2f} ms."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json")
    ap.add_argument("--results", help="write the agreement section of this markdown file (benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    cfg = {"ranks": args.ranks, "rounds": args.rounds}
    table = rows(spawn(_worker, args.ranks, cfg, timeout_s=args.timeout))
    command = "python benchmarks/agreement_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(cfg, table, machine_line(), command.strip())
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": table}, f, indent=1)
    if args.results:
        write_section(args.results, "agreement", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
