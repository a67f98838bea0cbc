"""cli: the ``python -m stpc`` verbs. In: command-line arguments. Out: plans, dumps, profiles
and demo runs on disk and stdout, through the library's stages (each verb adds no logic of its own).

trace (a model's graph: a zoo name, a factory or a Hugging Face config), plan (search one model on a cluster), calibrate
(measure this machine into a cost-model profile), demo (the README's main job), bench
(measured benchmarks, each regenerating its section of benchmarks/RESULTS.md).
"""
from __future__ import annotations

import sys

from stpc.cli.bench import main_bench
from stpc.cli.calibrate import main_calibrate
from stpc.cli.demo import main_demo
from stpc.cli.plan import main_plan
from stpc.cli.trace import main_trace

COMMANDS = {"demo": main_demo, "trace": main_trace, "plan": main_plan, "calibrate": main_calibrate,
            "bench": main_bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m stpc {" + ",".join(COMMANDS) + "} [options]   (--help on each)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


__all__ = ["main", "COMMANDS"]
