"""A ZeRO-2 plan's memory on 4 real gloo ranks against the planner's peak.

Megatron's distributed optimizer, as stpc plans and runs it (``planner.hints.megatron``):
each weight stored split over the DP axis, gathered once in forward and kept for its
backward (``Hints.keep_gathered``), its gradient reduce-scattered. The fidelity bench
measures no such plan; this holds the budget promise for it: the highest rank's measured
peak (live storages at a step's start plus the allocator's highest climb during it,
``bench_runtime._peak_of_step``, the highest of two steps after a warm-up) is no higher
than the planner's, and the planner over-counts by a bounded amount.

When written (forty-sixth session): planned 11.3% over measured on llama-tiny, 6.5% on
gpt-tiny. At these sizes the loss's logits dominate: the planner charges their gather over
TP into the loss one logits copy more than the runtime holds (the measured peak, in the
loss's backward, is two logits copies above the end of forward), and on gpt-tiny that
copy hides activations the planner under-counts (73 KB, one hidden-sized tensor per layer
left alive by the row-parallel linears): charging the gather no copy puts gpt-tiny 4.3%
under, which the first check catches.
"""
from __future__ import annotations

import pytest
import torch

from stpc.runtime.launch import spawn

pytestmark = pytest.mark.multirank

MODELS = ("gpt-tiny", "llama-tiny")


def _worker(rank, world):
    import stpc
    from stpc import models
    from stpc.cli.bench_runtime import StpcEngine, _peak_of_step
    from stpc.planner.hints import megatron

    out = {}
    for name in MODELS:
        torch.manual_seed(0)
        model = models.build(name)
        idx, tgt = models.example_inputs(models.get_config(name), 8, 64, device="cpu")
        hints = megatron((2, 2), dp_axis=0, tp_axis=1, distributed_optimizer=True)
        pm = stpc.compile(model, (2, 2), (idx, tgt), hints=hints, cache=False, cluster="cpu-local")
        engine = StpcEngine(name, "zero-2", pm, idx, tgt)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
        peaks = [_peak_of_step(engine, opt) for _ in range(3)]
        plan = pm.stpc.plan
        out[name] = {"measured": max(peaks[1:]), "planned": plan.peak_memory_bytes,
                     "kept": plan.stats.get("keep_gathered"),
                     "weights": sum(p.to_local().numel() for p in pm.parameters()),
                     "full": sum(p.numel() for p in pm.parameters())}
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


@pytest.mark.parametrize("name", MODELS)
def test_a_zero2_plans_measured_peak_is_within_its_planned_peak(results, name):
    r0 = results[0][name]
    assert r0["kept"] == [0]  # (kept gathered over the DP axis)
    assert r0["weights"] < r0["full"]  # (stored split: each rank holds part of the weights)
    measured = max(r[name]["measured"] for r in results)
    planned = r0["planned"]
    assert measured <= planned, f"{name}: measured {measured} B over the planned {planned:.0f} B"
    assert measured >= 0.85 * planned, f"{name}: measured {measured} B, planned {planned:.0f} B: over 15% apart"
