"""The plan cache: keyed by everything the search reads, atomic, JSON only, and a damaged
file is reported, ignored and rewritten."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import stpc  # noqa: E402
from stpc import models  # noqa: E402
from stpc.planner import Hints, Plan, search  # noqa: E402
from stpc.planner.cache import CacheWarning, PlanCache, plan_key  # noqa: E402
from stpc.runtime.launch import spawn  # noqa: E402


def _traced(batch=4, seq=16, name="gpt-tiny"):
    with torch.device("meta"):
        m = models.build(name)
    return stpc.trace(m, models.example_inputs(name, batch, seq))


@pytest.fixture(scope="module")
def tg():
    return _traced()


@pytest.fixture(scope="module")
def plan(tg):
    return search(tg, (2,))


def test_key_covers_what_the_search_reads(tg):
    base = plan_key(tg, (2,), "cpu-local", None, None, True)
    assert base == plan_key(_traced(), (2,), "cpu-local", None, None, True)  # deterministic
    others = [plan_key(_traced(batch=8), (2,), "cpu-local", None, None, True),      # input shapes
              plan_key(_traced(name="llama-tiny"), (2,), "cpu-local", None, None, True),  # graph
              plan_key(tg, (4,), "cpu-local", None, None, True),                    # mesh
              plan_key(tg, (2,), "dgx-h100", None, None, True),                     # cluster
              plan_key(tg, (2,), "cpu-local", 2**20, None, True),                   # budget
              plan_key(tg, (2,), "cpu-local", None, "megatron", True),              # hints
              plan_key(tg, (2,), "cpu-local", None, None, False),                   # temporal
              plan_key(tg, (2,), "cpu-local", None, Hints(param_exact={"wte.weight": ("S0",)}), True),
              plan_key(tg, (2,), "cpu-local", None, Hints(sequence_parallel=0), True),
              plan_key(tg, (2,), "cpu-local", None, Hints(keep_gathered=(0,)), True),
              plan_key(tg, (2,), "cpu-local", None, None, True, optimizer_impl="fused")]  # the step it is costed for
    assert None not in others and len(set(others + [base])) == len(others) + 1
    # predicates cannot be hashed faithfully: not cached
    assert plan_key(tg, (2,), "cpu-local", None, Hints(force=[(".", lambda s: True)]), True) is None


def test_round_trip_and_damaged_files(tmp_path, tg, plan):
    cache = PlanCache(tmp_path)
    key = plan_key(tg, (2,), "cpu-local", None, None, True)
    assert cache.get(key) is None
    path = cache.put(key, plan)
    assert cache.get(key).hash() == plan.hash()
    text = path.read_text()
    d = json.loads(text)
    unverified = json.dumps({k: v for k, v in d.items() if k != "plan_hash"})
    assert Plan.from_json(unverified).hash() == plan.hash()  # a whole plan, but nothing vouches for it
    nodes_list = json.dumps({**d, "nodes": list(d["nodes"])})
    for damaged in (text[: len(text) // 2],                                   # truncated
                    text.replace('"S0"', '"S1"', 1),                          # edited: hash no longer matches
                    pickle.dumps(plan).decode("latin-1"),                     # not JSON at all
                    "null", "1", "[]", '"plan"', "{}",                        # JSON, but not a plan object
                    unverified,                                               # no plan_hash: unverifiable
                    json.dumps({**d, "plan_hash": None}),
                    nodes_list):                                              # a field of the wrong type
        path.write_text(damaged)
        with pytest.warns(CacheWarning, match="corrupt"):
            assert cache.get(key) is None, damaged[:40]
        cache.put(key, plan)  # rewritten whole
        assert cache.get(key).hash() == plan.hash()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def _writer(directory, key, plan_json, n):
    from stpc.planner import Plan
    from stpc.planner.cache import PlanCache

    cache, plan = PlanCache(directory), Plan.from_json(plan_json)
    for _ in range(n):
        cache.put(key, plan)


def _reader(directory, key, n, out):
    from stpc.planner.cache import PlanCache

    cache, bad = PlanCache(directory), 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(n):
            try:
                cache.get(key)
            except Warning:
                bad += 1
    out.put(bad)


def test_concurrent_writers_never_leave_a_torn_file(tmp_path, plan):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    key = "k" * 64
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), key, plan.to_json(), 40)) for _ in range(2)]
    procs.append(ctx.Process(target=_reader, args=(str(tmp_path), key, 200, out)))
    for p in procs:
        p.start()
    try:
        assert out.get(timeout=120) == 0  # the reader never saw a partial file
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert PlanCache(tmp_path).get(key).hash() == plan.hash()


def _compile_twice(rank, world, directory):
    torch.manual_seed(0)
    ex = models.example_inputs("gpt-tiny", 4, 16, device="cpu")
    first = stpc.compile(models.build("gpt-tiny"), (world,), ex, cache=directory)
    torch.manual_seed(0)
    second = stpc.compile(models.build("gpt-tiny"), (world,), ex, cache=directory)
    return first.stpc.plan.stats.get("cache"), second.stpc.plan.stats.get("cache"), \
        first.stpc.plan.hash() == second.stpc.plan.hash()


@pytest.mark.multirank
def test_compile_reuses_a_cached_plan(tmp_path):
    results = spawn(_compile_twice, 2, str(tmp_path), timeout_s=300)
    assert any(first is None for first, _, _ in results)  # someone searched (the other may have read its file)
    for _, second, same in results:
        assert second and second.endswith(".json") and same
