"""The README's main job: a small GPT through the stpc pipeline on 4 CPU ranks."""
from __future__ import annotations

import argparse
import os


def main_demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m stpc demo", description=__doc__)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--out", default="out/demo", help="folder for graph dumps and the plan")
    a = p.parse_args(argv)

    import torch

    from stpc import dump, models, trace

    os.makedirs(a.out, exist_ok=True)
    with torch.device("meta"):
        model = models.build(a.model)
    tg = trace(model, models.example_inputs(a.model, 8, 64), name=a.model)
    print(f"[trace] {a.model}: {len(tg.graph.nodes)} nodes, {tg.num_params():,} parameters, "
          f"{tg.total_flops():.3g} forward FLOPs")
    for path in dump(tg, os.path.join(a.out, "traced.txt")):
        print(f"[dump] {path}")
    return 0
