"""Ranks never hang or silently disagree: a rank whose communication schedule differs is
caught before any step, and a rank that dies or stalls mid-ring makes the others raise a
CommFailure naming the operation within the timeout; the launcher leaves nothing behind."""
from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import make_plan  # noqa: E402

from stpc.runtime.launch import SpawnError, spawn  # noqa: E402

pytestmark = pytest.mark.multirank

B, S = 4, 16
TIMEOUT = 10


def _disagreeing_schedule(rank, world, plan_json):
    import stpc
    from stpc import models, passes
    from stpc.planner import Plan
    from stpc.runtime import ScheduleMismatch

    if rank == 1:  # as if rank 1 ran another version of a pass: one more collective in its program
        real = passes.comm_schedule
        passes.comm_schedule = lambda gm, plan, r: real(gm, plan, r) + [{"kind": "collective", "op": "all_reduce"}]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        stpc.compile(models.build("gpt-tiny"), None, models.example_inputs("gpt-tiny", B, S, device="cpu"),
                     plan=Plan.from_json(plan_json))
    except ScheduleMismatch as e:
        return str(e), time.perf_counter() - t0
    return None, 0.0


def test_a_rank_with_another_schedule_is_caught_before_any_step():
    plan = make_plan("gpt-tiny", "2", "megatron", B, S).to_json()
    msgs = spawn(_disagreeing_schedule, 2, plan, timeout_s=120)
    assert all(m and "would issue other collectives or P2P transfers" in m for m, _ in msgs), msgs
    assert "ranks [1]" in msgs[0][0] and "ranks [0]" in msgs[1][0]


def _ring_then_fail(rank, world, plan_json, how):
    import signal

    import stpc
    from stpc import models
    from stpc.planner import Plan
    from stpc.runtime import CommFailure
    from stpc.runtime.ops import ring

    torch.manual_seed(0)
    idx, tgt = models.example_inputs("llama-tiny", B, S, device="cpu")
    pm = stpc.compile(models.build("llama-tiny"), None, (idx, tgt), plan=Plan.from_json(plan_json),
                      timeout_s=TIMEOUT)
    pm(idx, tgt).backward()  # one healthy step
    if rank == world - 1:
        real, calls = ring._post, [0]

        def post(*a, **k):  # the second transfer of the next ring: in the middle of the ring
            calls[0] += 1
            if calls[0] == 2:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3 * TIMEOUT)  # stalled: the others must give up first
            return real(*a, **k)
        ring._post = post
    t0 = time.perf_counter()
    try:
        pm(idx, tgt).backward()
    except CommFailure as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    except RuntimeError as e:  # a stalled rank wakes up to peers that are gone
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_rank_that_dies_or_stalls_mid_ring_stops_the_others(how):
    plan = make_plan("llama-tiny", "4", "ag_rs", B, S).to_json()
    t0 = time.monotonic()
    if how == "kill":
        with pytest.raises(SpawnError) as e:
            spawn(_ring_then_fail, 4, plan, how, timeout_s=300, grace_s=3 * TIMEOUT)
        assert e.value.rank == 3 and "without reporting" in e.value.remote_traceback
        survivors = e.value.values
    else:
        survivors = dict(enumerate(spawn(_ring_then_fail, 4, plan, how, timeout_s=300)[:3]))
    assert sorted(survivors) == [0, 1, 2], survivors
    for r, res in survivors.items():
        assert res["error"] and res["error"].startswith("stpc: "), (r, res)
        assert any(k in res["error"] for k in ("stpc::ring_", "stpc::primepar", "all_gather", "reduce_scatter")), res
        assert ("forward" in res["error"] or "backward" in res["error"]) and "Fix:" in res["error"], res
        assert res["seconds"] < TIMEOUT + 15, (r, res)  # within the timeout (and some slack on 2 cores)
    assert time.monotonic() - t0 < 250
    assert multiprocessing.active_children() == []  # nobody left behind
