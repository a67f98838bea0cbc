"""``python -m stpc bench <name>``: measured benchmarks, each regenerating its own section of
benchmarks/RESULTS.md (``--results FILE``; the section sits between
``<!-- bench:<name> -->`` and ``<!-- /bench:<name> -->`` markers and is replaced whole,
so no figure in it is ever typed by hand).

Benchmarks: ``runtime`` (stpc's programs against torch's own engines, side by side on the
same ranks; ``stpc.cli.bench_runtime``), ``fidelity`` (the planner's predicted peak memory
and step time against measured runs of five plans; ``stpc.cli.bench_fidelity``).

Both take the shared flags where they mean something (``--model``, ``--layers``,
``--batch``, ``--seq``, ``--ranks``, ``--steps``, ``--cluster``, ``--timeout``, ``--json``,
``--quiet``, ``--debug``); ``--quiet`` prints only the line saying which targets were met.
Progress (a bar over the timed rounds) goes to stderr when it is a terminal. Exit codes:
0 measured (whether or not the targets were met), 1 a failure, 2 a usage error.
"""
from __future__ import annotations

import os
import platform
from datetime import datetime, timezone

import torch

from stpc.cli._common import UsageError, verb
from stpc.cli.bench_fidelity import main_fidelity
from stpc.cli.bench_runtime import main_runtime

BENCHES = {"runtime": main_runtime, "fidelity": main_fidelity}


def machine_line() -> str:
    """One line naming where a benchmark ran."""
    cpu = platform.processor() or platform.machine()
    return (f"machine: {platform.machine()} {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"python {platform.python_version()}; {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")


def write_section(path: str, name: str, text: str) -> None:
    """Replace the ``name`` section of the markdown file at ``path`` with ``text`` (appended,
    with its markers, if the file has none)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    body = f"{start}\n{text.rstrip()}\n{end}\n"
    old = open(path).read() if os.path.exists(path) else ""
    if start in old and end in old:
        head, rest = old.split(start, 1)
        new = head + body + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + body
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


USAGE = ("usage: python -m stpc bench {" + ",".join(BENCHES) + "} [options]   (--help on each)\n\n"
         + __doc__.split("\n\n", 1)[1])


@verb
def main_bench(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if not argv or argv[0] not in BENCHES:
        raise UsageError(f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named",
                         "give one of " + ", ".join(BENCHES) + " (python -m stpc bench --help)")
    return BENCHES[argv[0]](argv[1:], machine_line, write_section)


__all__ = ["main_bench", "write_section", "machine_line", "BENCHES"]
