"""Megatron on a 2 x 2 mesh, with and without its distributed optimizer: each plan's peak
measured on 4 real gloo ranks against the planner's.

DP on one axis, TP+SP on the other (``planner.hints.megatron``); with the distributed
optimizer, as stpc plans and runs it, each weight is stored split over DP, gathered once in
forward and kept for its backward (ZeRO-2, ``Hints.keep_gathered``). The fidelity bench
measures neither on two mesh axes. The measured peak is the highest rank's live storages
at a step's start plus the allocator's highest climb during it
(``bench_runtime._peak_of_step``), the highest of two steps after a warm-up; the planner's
must be within 5% of it (issue 12's target), as the fidelity bench holds its plans.

At these tiny sizes the loss's logits and the rotary tables weigh: when written (the
forty-sixth session) the planner was 4.7-11.3% over on these four plans (a logits copy
too many for their gather into the loss, q and k counted as kept by their rotary
products), with the logits the loss keeps, gathered, counted at their split size; fixed,
-1.3% to +1.1%.
"""
from __future__ import annotations

import pytest
import torch

from stpc.runtime.launch import spawn

pytestmark = pytest.mark.multirank

CASES = [(name, zero) for name in ("gpt-tiny", "llama-tiny") for zero in (False, True)]


def _worker(rank, world):
    import stpc
    from stpc import models
    from stpc.cli.bench_runtime import StpcEngine, _peak_of_step
    from stpc.planner.hints import megatron

    out = {}
    for name, zero in CASES:
        torch.manual_seed(0)
        model = models.build(name)
        idx, tgt = models.example_inputs(models.get_config(name), 8, 64, device="cpu")
        hints = megatron((2, 2), dp_axis=0, tp_axis=1, distributed_optimizer=zero, sequence_parallel=True)
        pm = stpc.compile(model, (2, 2), (idx, tgt), hints=hints, cache=False, cluster="cpu-local")
        engine = StpcEngine(name, "megatron", pm, idx, tgt)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
        peaks = [_peak_of_step(engine, opt) for _ in range(3)]
        plan = pm.stpc.plan
        out[(name, zero)] = {"measured": max(peaks[1:]), "planned": plan.peak_memory_bytes,
                             "kept": plan.stats.get("keep_gathered")}
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 4, timeout_s=300)


@pytest.mark.parametrize("name,zero", CASES, ids=[f"{n}-{'zero2' if z else 'plain'}" for n, z in CASES])
def test_the_planned_peak_is_within_5_percent_of_the_measured(results, name, zero):
    r0 = results[0][(name, zero)]
    assert r0["kept"] == ([0] if zero else None)  # (ZeRO-2: kept gathered over the DP axis)
    measured = max(r[(name, zero)]["measured"] for r in results)
    err = r0["planned"] / measured - 1
    assert abs(err) <= 0.05, f"{name} (zero2 {zero}): planned {r0['planned']:.0f} B, measured {measured} B ({err:+.1%})"
