"""``python -m stpc trace``: trace a model on meta tensors and dump its graph. ``--model`` as
for ``plan``: a zoo name, ``package.module:factory``, or a Hugging Face ``config.json``
(``stpc.cli._common``); an unknown one is a usage error (exit code 2)."""
from __future__ import annotations

import argparse
import sys
import time

from stpc.cli._common import DEFAULT_BATCH, DEFAULT_SEQ, MODEL_HELP, UnknownModel, meta_trace
from stpc.frontend import dump


def main_trace(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m stpc trace",
                                description="Trace a model on meta tensors and dump its graph.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--layers", type=int, default=None, help="build the model with this many layers")
    p.add_argument("--batch", type=int, default=None, help=f"global batch (default {DEFAULT_BATCH})")
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (default {DEFAULT_SEQ}, "
                   "capped at the model's max)")
    p.add_argument("--dump", default=None, help="write the node table here (and a .dot twin)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        tg, batch, seq = meta_trace(a.model, a.batch, a.seq, layers=a.layers)
    except UnknownModel as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    n_nodes = len(tg.graph.nodes)
    print(f"model {a.model}  batch {batch}  seq {seq}")
    print(f"nodes {n_nodes}  parameters {tg.num_params():,}  forward FLOPs {tg.total_flops():.4g}  "
          f"trace {dt:.2f}s")
    if a.dump:
        for path in dump(tg, a.dump):
            print(f"wrote {path}")
    return 0
