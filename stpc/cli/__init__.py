"""cli: the ``python -m stpc`` verbs. In: command-line arguments. Out: plans, dumps, profiles
and demo runs on disk and stdout, through the library's stages (each verb adds no logic of its own).

trace (a model's graph: a zoo name, a factory or a Hugging Face config), plan (search one model on a cluster), calibrate
(measure this machine into a cost-model profile), demo (the README's main job), bench
(measured benchmarks, each regenerating its section of benchmarks/RESULTS.md).

Every verb takes the same flags where they overlap (``stpc.cli._common.add_flags``) and
``--quiet`` / ``--debug``; exits 0 on success, 1 on a failure, 2 on a usage error, with an
error as one line on stderr (``error: <cause>. Fix: <what to do>``; the traceback only
under ``--debug`` or ``STPC_DEBUG=1``); and shows progress on stderr only when it is a
terminal (``stpc.cli._progress``).
"""
from __future__ import annotations

import sys

from stpc.cli._common import UsageError, run_guarded
from stpc.cli.bench import main_bench
from stpc.cli.calibrate import main_calibrate
from stpc.cli.demo import main_demo
from stpc.cli.plan import main_plan
from stpc.cli.trace import main_trace

COMMANDS = {"trace": main_trace, "plan": main_plan, "calibrate": main_calibrate, "demo": main_demo,
            "bench": main_bench}
ABOUT = {"trace": "trace a model on meta tensors: nodes, parameters, FLOPs (--dump: the node table)",
         "plan": "plan one training step of a model on a mesh and cluster, and print the plan",
         "calibrate": "measure this machine into a cost-model profile (give it to --cluster)",
         "demo": "plan, compile and train a small GPT on 4 CPU ranks, checked against one device",
         "bench": "measured benchmarks: runtime (stpc against torch's engines), fidelity (predicted vs measured)"}
USAGE = "usage: python -m stpc {" + ",".join(COMMANDS) + "} [options]   (--help on each)"
HELP = (USAGE + "\n\nverbs:\n" + "".join(f"  {k:10} {v}\n" for k, v in ABOUT.items()) + """
shared flags, the same on every verb that takes them: --model, --layers, --batch, --seq,
--mesh, --cluster, --dtype, --budget-gib, --json, --ranks, --steps, --timeout; on every
verb: -q/--quiet (only the result on stdout, no progress) and --debug (tracebacks).

exit codes: 0 ok, 1 failure, 2 usage error. An error is one line on stderr,
"error: <cause>. Fix: <what to do>"; --debug or STPC_DEBUG=1 adds the traceback.
Progress goes to stderr, only when it is a terminal.
""")


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help", "help"):
        print(HELP, end="")
        return 0
    if not argv or argv[0].startswith("-"):
        raise UsageError(f"no verb given{f' (got {argv[0]})' if argv else ''}",
                         "give one of " + ", ".join(COMMANDS) + " (python -m stpc --help)")
    if argv[0] not in COMMANDS:
        raise UsageError(f"unknown verb {argv[0]!r}", "give one of " + ", ".join(COMMANDS) + " (python -m stpc --help)")
    return COMMANDS[argv[0]](argv[1:])


def main(argv: list[str] | None = None) -> int:
    """``python -m stpc <verb> [options]``: the verb's exit code (0 ok, 1 failure, 2 usage)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_guarded(_dispatch, argv)


__all__ = ["main", "COMMANDS"]
