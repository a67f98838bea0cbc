"""``python -m stpc trace``: trace a model on meta tensors (nothing allocated) and print its
size: nodes, parameters, forward FLOPs. ``--model`` as for ``plan``: a zoo name,
``package.module:factory``, or a Hugging Face ``config.json`` (``stpc.cli._common``); an
unknown one is a usage error (exit code 2). ``--dump FILE`` writes the node table (and a
.dot twin); ``--json FILE`` the numbers.
"""
from __future__ import annotations

import time

from stpc.cli._common import DEFAULT_BATCH, DEFAULT_SEQ, Parser, add_flags, meta_trace, verb, write_json
from stpc.frontend import dump


@verb
def main_trace(argv: list[str]) -> int:
    p = Parser("python -m stpc trace", __doc__)
    add_flags(p, {"model": {"required": True}, "layers": {"shown": "the model's own"},
                  "batch": {"shown": DEFAULT_BATCH},
                  "seq": {"shown": f"{DEFAULT_SEQ}, capped at the model's position table"},
                  "dtype": {"default": "fp32"}, "json": {"shown": "none"}})
    p.add_argument("--dump", default=None, metavar="FILE", help="write the node table here (and a .dot twin)")
    a = p.parse_args(argv)
    say = (lambda *x, **k: None) if a.quiet else print
    t0 = time.perf_counter()
    tg, batch, seq = meta_trace(a.model, a.batch, a.seq, a.dtype, layers=a.layers, progress=not a.quiet)
    dt = time.perf_counter() - t0
    n_nodes = len(tg.graph.nodes)
    say(f"model {a.model}  batch {batch}  seq {seq}  {a.dtype}")
    print(f"nodes {n_nodes}  parameters {tg.num_params():,}  forward FLOPs {tg.total_flops():.4g}  "
          f"trace {dt:.2f}s")
    if a.dump:
        for path in dump(tg, a.dump):
            say(f"wrote {path}")
    if a.json:
        write_json(a.json, {"model": a.model, "batch": batch, "seq": seq, "dtype": a.dtype,
                            "num_nodes": n_nodes, "num_params": tg.num_params(), "forward_flops": tg.total_flops(),
                            "trace_time_s": dt, "analysis_time_s": tg.meta.get("analysis_s")})
        say(f"wrote {a.json}")
    return 0
