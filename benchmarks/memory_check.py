"""Estimated vs measured peak memory of single-device AdamW (fp32) training steps.

    .venv/bin/python benchmarks/memory_check.py

Estimate: memory_tools.estimate_training_peak (shapes only, FakeTensors).
Measured: torch.distributed._tools.mem_tracker.MemTracker over 2 real steps on CPU.
A second table sets the graph-derived saved activations beside the closed-form
per-layer formula (cost_models.estimator, fp32 activations) as a cross-check.
"""
from __future__ import annotations

import sys
import time

import torch

from stpc import models
from stpc.cost_models.estimator import closed_form_memory

from memory_tools import estimate_training_peak, measure_training_peak  # (this folder)

CASES = [("gpt-tiny", 8, 64), ("llama-tiny", 8, 64), ("gpt-50m", 8, 256)]
MiB = 2**20


def main() -> int:
    rows = []
    for name, batch, seq in CASES:
        torch.manual_seed(0)
        model = models.build(name)
        inputs = models.example_inputs(name, batch, seq, device="cpu")
        t0 = time.perf_counter()
        est = estimate_training_peak(model, inputs)
        t_est = time.perf_counter() - t0
        measured = measure_training_peak(model, inputs, steps=2)
        cf = closed_form_memory(models.CONFIGS[name], seq=seq, batch=batch, dtype="fp32", layout="fp32-adam")
        rows.append((name, batch, seq, models.num_params(model), est, measured, t_est, cf))

    print("| model | params | batch x seq | estimated peak (MiB) | measured peak (MiB) | error | "
          "peak phase | estimate time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, batch, seq, n, est, measured, t_est, _ in rows:
        print(f"| {name} | {n / 1e6:.2f}M | {batch} x {seq} | {est.peak / MiB:.2f} | {measured / MiB:.2f} | "
              f"{est.peak / measured - 1:+.2%} | {est.phase} | {t_est:.2f} |")
    print("\nestimate breakdown (MiB): weights, grads, AdamW state, saved activations, "
          "forward / backward / optimizer-step peaks above weights + state\n")
    print("| model | weights | grads | AdamW state | activations | fwd | bwd | grads + step scratch |")
    print("|---|---|---|---|---|---|---|---|")
    for name, *_, est, _m, _t, _cf in rows:
        print(f"| {name} | {est.params / MiB:.2f} | {est.grads / MiB:.2f} | {est.optimizer / MiB:.2f} | "
              f"{est.activations / MiB:.2f} | {est.forward_peak / MiB:.2f} | {est.backward_peak / MiB:.2f} | "
              f"{(est.grads + est.step_transient) / MiB:.2f} |")
    print("\nclosed form (4D-estimator style per-layer formula + fp32 logits) vs the autograd graph's "
          "saved activations\n")
    print("| model | closed-form activations (MiB) | graph-derived (MiB) | ratio |")
    print("|---|---|---|---|")
    for name, *_, est, _m, _t, cf in rows:
        a = cf.values["activations"]
        print(f"| {name} | {a / MiB:.2f} | {est.activations / MiB:.2f} | {est.activations / a:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
