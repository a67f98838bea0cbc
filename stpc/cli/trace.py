"""``python -m stpc trace``: trace a zoo model on meta tensors and dump its graph."""
from __future__ import annotations

import argparse
import time

from stpc.cli._common import DEFAULT_BATCH, DEFAULT_SEQ, meta_trace
from stpc.frontend import dump


def main_trace(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m stpc trace",
                                description="Trace a zoo model on meta tensors and dump its graph.")
    p.add_argument("--model", required=True, help="zoo config name, e.g. gpt-tiny, llama2-70b")
    p.add_argument("--batch", type=int, default=None, help=f"global batch (default {DEFAULT_BATCH})")
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (default {DEFAULT_SEQ}, "
                   "capped at the model's max)")
    p.add_argument("--dump", default=None, help="write the node table here (and a .dot twin)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    tg, batch, seq = meta_trace(a.model, a.batch, a.seq)
    dt = time.perf_counter() - t0
    n_nodes = len(tg.graph.nodes)
    print(f"model {a.model}  batch {batch}  seq {seq}")
    print(f"nodes {n_nodes}  parameters {tg.num_params():,}  forward FLOPs {tg.total_flops():.4g}  "
          f"trace {dt:.2f}s")
    if a.dump:
        for path in dump(tg, a.dump):
            print(f"wrote {path}")
    return 0
