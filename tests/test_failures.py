"""Ranks never hang or silently disagree: a rank whose communication schedule differs is
caught before any step, within seconds, and a rank that dies or stalls mid-ring makes the
others raise a CommFailure naming the operation within the timeout; the launcher leaves
nothing behind. The agreement's own collectives run on the device the world's backend
takes (the CPU under gloo, this rank's GPU under NCCL alone)."""
from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _multirank import make_plan  # noqa: E402

from stpc.runtime import PlanMismatch, ScheduleMismatch, agreement  # noqa: E402
from stpc.runtime.launch import SpawnError, spawn  # noqa: E402

B, S = 4, 16
TIMEOUT = 10
AGREE_S = 5  # the schedule check answers within this many seconds of the last rank reaching it


def _disagreeing_schedule(rank, world, plan_json):
    import stpc
    from stpc import models, passes, runtime
    from stpc.planner import Plan
    from stpc.runtime import ScheduleMismatch

    if rank == 1:  # as if rank 1 ran another version of a pass: one more collective in its program
        real = passes.comm_schedule
        passes.comm_schedule = lambda gm, plan, r: real(gm, plan, r) + [{"kind": "collective", "op": "all_reduce"}]
    check, entered = runtime.check_schedule_agreement, []

    def timed_check(*a, **k):  # when this rank reached the check (wall clock: comparable across ranks)
        entered.append(time.time())
        return check(*a, **k)
    runtime.check_schedule_agreement = timed_check
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        stpc.compile(models.build("gpt-tiny"), None, models.example_inputs("gpt-tiny", B, S, device="cpu"),
                     plan=Plan.from_json(plan_json))
    except ScheduleMismatch as e:
        return {"error": str(e), "compile_s": time.perf_counter() - t0, "entered": entered, "raised": time.time()}
    return {"error": None, "compile_s": time.perf_counter() - t0, "entered": entered, "raised": None}


@pytest.mark.multirank
def test_a_rank_with_another_schedule_is_caught_before_any_step():
    plan = make_plan("gpt-tiny", "2", "megatron", B, S).to_json()
    res = spawn(_disagreeing_schedule, 2, plan, timeout_s=120)
    assert all(r["error"] and "would issue other collectives or P2P transfers" in r["error"] for r in res), res
    assert "ranks [1]" in res[0]["error"] and "ranks [0]" in res[1]["error"]
    assert all(len(r["entered"]) == 1 for r in res), res  # one check, before any step
    # within seconds: every rank raises once all have reached the check (no collective timeout
    # is waited out), and the whole compile (trace, lower, agree) takes what a healthy one takes
    last = max(r["entered"][0] for r in res)
    for r in res:
        assert r["raised"] - last < AGREE_S, res
        assert r["compile_s"] < 60, res
    assert abs(res[0]["raised"] - res[1]["raised"]) < AGREE_S, res


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


@pytest.mark.multirank
@pytest.mark.parametrize("how", ["kill", pytest.param("stall", marks=pytest.mark.slow)])
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


# ---------------------------------------------------------------- the agreement's device (no GPU needed)


def test_agreement_runs_on_the_cpu_under_gloo(world_of_one):
    assert agreement._comm_device() == torch.device("cpu")
    agreement.check_plan_agreement("ab" * 32)
    agreement.check_tensors_agree({"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)})
    agreement.check_schedule_agreement("mine", ["mine"])
    with pytest.raises(ScheduleMismatch, match="ranks \\[0\\]"):
        agreement.check_schedule_agreement("mine", ["another"])


def _group(*devices: str) -> dist.ProcessGroup:
    """A ProcessGroup whose backends are registered for ``devices`` (a gloo backend stands in
    for NCCL: only the devices they are registered for are read)."""
    store = dist.HashStore()
    pg, backend = dist.ProcessGroup(store, 0, 1), dist.ProcessGroupGloo(store, 0, 1)
    kinds = {"cpu": dist.ProcessGroup.BackendType.GLOO, "cuda": dist.ProcessGroup.BackendType.NCCL}
    for d in devices:
        pg._register_backend(torch.device(d), kinds[d], backend)
    return pg


def test_agreement_runs_on_this_ranks_gpu_under_nccl_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert agreement._comm_device(_group("cuda")) == torch.device("cuda", 2)  # init_process_group("nccl")
    assert agreement._comm_device(_group("cpu", "cuda")) == torch.device("cpu")  # "cpu:gloo,cuda:nccl"
    assert agreement._comm_device(_group("cpu")) == torch.device("cpu")


class _Gathered(Exception):
    pass


@pytest.mark.parametrize("check", [
    lambda: agreement.check_plan_agreement("ab" * 32),
    lambda: agreement.check_tensors_agree({"w": torch.ones(3)}),
    lambda: agreement.check_schedule_agreement("mine", ["mine", "mine"]),
], ids=["plan", "tensors", "schedule"])
def test_every_agreement_collective_takes_the_groups_device(monkeypatch, check):
    seen = []

    def all_gather(out, mine, group=None):
        seen.append({mine.device.type} | {t.device.type for t in out})
        raise _Gathered

    def all_reduce(t, op=None, group=None):
        seen.append({t.device.type})
        raise _Gathered

    monkeypatch.setattr(agreement, "_comm_device", lambda group=None: torch.device("meta"), raising=False)  # as cuda
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(_Gathered):
        check()
    assert seen == [{"meta"}]


def _plan_check_against(monkeypatch, others: list[str]):
    """check_plan_agreement on rank 0 of a world of one that stands for ``1 + len(others)``
    ranks, the others holding the hashes ``others``: the collectives answer as they would
    there. Returns the collectives it issued and the error it raised (or None)."""
    issued = []

    def word(h: str) -> int:
        return int.from_bytes(bytes.fromhex(h)[:8], "little") >> 2

    def all_reduce(t, op=None, group=None):
        issued.append("all_reduce")
        assert op == dist.ReduceOp.MAX and t.dtype == torch.int64 and t.numel() == 2
        words = [t[0].item()] + [word(h) for h in others]
        t.copy_(torch.tensor([max(words), -min(words)]))

    def all_gather(out, mine, group=None):
        issued.append("all_gather")
        for o, h in zip(out, [bytes(mine.tolist()).hex()] + others):
            o.copy_(torch.tensor(list(bytes.fromhex(h)), dtype=torch.uint8))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1 + len(others))
    try:
        agreement.check_plan_agreement("ab" * 32)
    except PlanMismatch as e:
        return issued, str(e)
    return issued, None


def test_plan_agreement_is_one_small_all_reduce_where_the_ranks_agree(world_of_one, monkeypatch):
    assert _plan_check_against(monkeypatch, ["ab" * 32] * 3) == (["all_reduce"], None)


@pytest.mark.parametrize("differs", [[2], [1, 3]], ids=["one rank", "two ranks"])
def test_plan_agreement_names_the_ranks_that_differ(world_of_one, monkeypatch, differs):
    """The all-reduce finds that some hash differs; the all-gather that follows (on every rank:
    all read the same verdict) names the ranks."""
    issued, error = _plan_check_against(monkeypatch, ["cd" * 32 if r in differs else "ab" * 32 for r in (1, 2, 3)])
    assert issued == ["all_reduce", "all_gather"], issued
    assert error is not None and f"ranks {differs}" in error and "Fix:" in error, error
