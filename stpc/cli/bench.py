"""``python -m stpc bench <name>``: measured benchmarks, each regenerating its own section of
benchmarks/RESULTS.md (``--results FILE``; the section sits between
``<!-- bench:<name> -->`` and ``<!-- /bench:<name> -->`` markers and is replaced whole,
so no figure in it is ever typed by hand).

Benchmarks:

* ``runtime``: stpc's programs against torch's own engines, side by side on the same
  ranks (measured; ``stpc.cli.bench_runtime``);
* ``fidelity``: the planner's predicted peak memory and step time against measured runs of
  five plans (``stpc.cli.bench_fidelity``);
* ``primepar``: PrimePar's six models on 4-32 devices of ``primepar-v100`` and ``dgx-h100``,
  stpc against each baseline (modelled; ``stpc.cli.bench_primepar``);
* ``planner``: the planner's trace and search times on those cells beside PrimePar's
  published search times, and Llama-3-8B on 64 devices (measured on this machine;
  ``stpc.cli.bench_planner``);
* ``kernel``: the Triton ring-step kernel against ``torch.addmm`` on llama2-7b's ring-step
  GEMM shapes (measured where a CUDA GPU is available, else the section says not measured;
  ``stpc.cli.bench_kernel``).

``python -m stpc bench summary --results FILE`` measures nothing: it writes the file's
``summary`` section, each bench section's headline copied out of it
(``stpc.cli.bench_summary``). A bench that writes its section into a file that has a summary
section writes the summary again too, so the two never disagree.

Each takes the shared flags where they mean something (``--model``, ``--layers``,
``--batch``, ``--seq``, ``--ranks``, ``--steps``, ``--cluster``, ``--budget-gib``,
``--timeout``, ``--json``, ``--quiet``, ``--debug``) and ``--results FILE``; ``--quiet``
prints only the headline line. Progress goes to stderr when it is a terminal. Exit codes:
0 done (whether or not the targets were met), 1 a failure, 2 a usage error.
"""
from __future__ import annotations

import argparse
import os
import platform
from datetime import datetime, timezone

import torch

from stpc.cli._common import UsageError, verb
from stpc.cli.bench_fidelity import main_fidelity
from stpc.cli.bench_kernel import main_kernel
from stpc.cli.bench_planner import main_planner
from stpc.cli.bench_primepar import main_primepar
from stpc.cli.bench_runtime import main_runtime
from stpc.cli.bench_summary import markers, summary

BENCHES = {"runtime": main_runtime, "fidelity": main_fidelity, "primepar": main_primepar, "planner": main_planner,
           "kernel": main_kernel}


def machine_line() -> str:
    """One line naming where a benchmark ran."""
    cpu = platform.processor() or platform.machine()
    return (f"machine: {platform.machine()} {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"python {platform.python_version()}; {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")


def _replaced(old: str, name: str, text: str) -> str:
    start, end = markers(name)
    body = f"{start}\n{text.rstrip()}\n{end}\n"
    if start in old and end in old:
        head, rest = old.split(start, 1)
        new = head + body + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + body
    return new


def write_section(path: str, name: str, text: str) -> None:
    """Replace the ``name`` section of the markdown file at ``path`` with ``text`` (appended,
    with its markers, if the file has none); where the file has a ``summary`` section, write
    that again from the sections as they now stand."""
    old = open(path).read() if os.path.exists(path) else ""
    new = _replaced(old, name, text)
    if name != "summary" and markers("summary")[0] in new:
        new = _replaced(new, "summary", summary(new))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


USAGE = ("usage: python -m stpc bench {" + ",".join([*BENCHES, "summary"]) + "} [options]   (--help on each)\n\n"
         + __doc__.split("\n\n", 1)[1])


@verb
def main_bench(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if argv and argv[0] == "summary":
        return _main_summary(argv[1:])
    if not argv or argv[0] not in BENCHES:
        raise UsageError(f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named",
                         "give one of " + ", ".join(BENCHES) + " or summary (python -m stpc bench --help)")
    return BENCHES[argv[0]](argv[1:], machine_line, write_section)


def _main_summary(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m stpc bench summary",
                                 description="Write FILE's summary section from its bench sections (measures nothing).")
    ap.add_argument("--results", required=True, metavar="FILE", help="the results markdown, e.g. benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    if not os.path.exists(args.results):
        raise UsageError(f"no file {args.results}", "name the results markdown the benches write (--results FILE)")
    write_section(args.results, "summary", summary(open(args.results).read()))
    print(f"wrote the summary section of {args.results}")
    return 0


__all__ = ["main_bench", "write_section", "machine_line", "BENCHES"]
