"""Command line: ``python -m stpc {demo,trace,plan,calibrate} ...``.

Every subcommand calls the library's stages; it adds no logic of its own.
"""
from __future__ import annotations

import argparse
import sys
import time

# Planning defaults, the same for every model unless --batch/--seq are given.
DEFAULT_BATCH = 8
DEFAULT_SEQ = 2048


def _meta_trace(name: str, batch: int | None, seq: int | None):
    import torch

    from stpc import models, trace

    cfg = models.get_config(name)
    seq = min(seq or DEFAULT_SEQ, cfg.max_seq)
    batch = batch or DEFAULT_BATCH
    with torch.device("meta"):
        model = models.build(cfg)
    return trace(model, models.example_inputs(cfg, batch, seq, device="meta"), name=name), batch, seq


def cmd_trace(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m stpc trace",
                                description="Trace a zoo model on meta tensors and dump its graph.")
    p.add_argument("--model", required=True, help="zoo config name, e.g. gpt-tiny, llama2-70b")
    p.add_argument("--batch", type=int, default=None, help=f"global batch (default {DEFAULT_BATCH})")
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (default {DEFAULT_SEQ}, "
                   "capped at the model's max)")
    p.add_argument("--dump", default=None, help="write the node table here (and a .dot twin)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    tg, batch, seq = _meta_trace(a.model, a.batch, a.seq)
    dt = time.perf_counter() - t0
    n_nodes = len(tg.graph.nodes)
    print(f"model {a.model}  batch {batch}  seq {seq}")
    print(f"nodes {n_nodes}  parameters {tg.num_params():,}  forward FLOPs {tg.total_flops():.4g}  "
          f"trace {dt:.2f}s")
    if a.dump:
        from stpc import dump
        for path in dump(tg, a.dump):
            print(f"wrote {path}")
    return 0


def cmd_plan(argv: list[str]) -> int:
    from stpc.cli_plan import main_plan
    return main_plan(argv)


def cmd_calibrate(argv: list[str]) -> int:
    from stpc.calibrate import main_calibrate
    return main_calibrate(argv)


def cmd_demo(argv: list[str]) -> int:
    from stpc.demo import main_demo
    return main_demo(argv)


COMMANDS = {"demo": cmd_demo, "trace": cmd_trace, "plan": cmd_plan, "calibrate": cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m stpc {" + ",".join(COMMANDS) + "} [options]   (--help on each)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
