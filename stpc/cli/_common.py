"""What the verbs share: planning defaults and tracing a zoo model on meta tensors."""
from __future__ import annotations

import torch

from stpc.compile import trace
from stpc.frontend import TracedGraph, models

# Planning defaults, the same for every model unless --batch/--seq are given.
DEFAULT_BATCH = 8
DEFAULT_SEQ = 2048
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def meta_trace(name: str, batch: int | None = None, seq: int | None = None,
               dtype: str = "fp32") -> tuple[TracedGraph, int, int]:
    """Trace (and analyse) zoo model ``name`` on meta tensors in ``dtype``: (graph, batch, seq),
    with the defaults filled in and ``seq`` capped at the model's position table."""
    cfg = models.get_config(name)
    seq = min(seq or DEFAULT_SEQ, cfg.max_seq)
    batch = batch or DEFAULT_BATCH
    with torch.device("meta"):
        model = models.build(cfg).to(TORCH_DTYPES[dtype])
    return trace(model, models.example_inputs(cfg, batch, seq, device="meta"), name=name), batch, seq
