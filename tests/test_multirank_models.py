"""The proof: whole models on real gloo ranks match the single-device model.

Each case compiles gpt-tiny / llama-tiny with ``stpc.compile`` under a plan forced
to one family (Megatron TP+SP, AG-ring/RS-ring, P2x2, data parallel, ZeRO) or
solved, trains next to an unsharded copy (20 AdamW steps for the solved, ring and
P2x2 plans and an odd shape; a few SGD/AdamW steps for the other families) and
checks, every step, the loss, every parameter's full gradient and every parameter
after the optimizer step (fp32, rtol 1e-4; NaN or inf fails). Plans are made once in
the parent (single process) and shipped to the ranks; many cases share one spawn to
keep the CPU time low. The default run takes part of each matrix (``halves``,
``one_per_family``: every family, both models and both meshes still in it); ``-m slow``
runs the rest.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _multirank import _rel, full_grads, make_plan, run_cases  # noqa: E402

from stpc import models  # noqa: E402
from stpc.planner import Plan  # noqa: E402
from stpc.runtime.launch import spawn  # noqa: E402

pytestmark = pytest.mark.multirank

B, S = 4, 16  # batch and sequence: divisible by every mesh axis used here


def _case(model, family, mesh, steps=3, opt="adamw", overrides=None, label=None):
    """One parity case: ``model`` (with its config ``overrides``; ``label`` names the variant
    in the case's id) planned under ``family`` on ``mesh``. (gpt-tiny's linears have biases:
    a P2x2 one adds its grid column's slice.)"""
    overrides = dict(overrides or {})
    plan = make_plan(model, mesh, family, B, S, **overrides)
    return dict(id=f"{label or model}/{family}/{mesh}", model=model, overrides=overrides, plan=plan.to_json(),
                batch=B, seq=S, steps=steps, opt=opt)


def _check(results, cases):
    # every case ran, every step of it, on every rank
    assert [len(r) for r in results] == [len(cases)] * len(results)
    assert [(r["case"], r["steps"]) for r in results[0]] == [(c["id"], c["steps"]) for c in cases]
    bad = []
    for r in results[0]:  # every rank computed the same gathered numbers; rank 0 speaks
        # written so that a NaN ratio fails too (nan <= 1 is False)
        if not (r["loss"] <= 1 and r["grad"] <= 1 and r["param"] <= 1) or r.get("missing"):
            bad.append(f"{r['case']}: loss ratio {r['loss']:.3g}, worst grad {r['grad_name']} ratio "
                       f"{r['grad']:.3g}, worst parameter {r['param_name']} ratio {r['param']:.3g}, "
                       f"missing {r.get('missing')}, losses {r['losses']}")
    assert not bad, "\n".join(bad)
    for rank_res in results[1:]:  # and all ranks agree on the loss they returned
        assert [x["losses"] for x in rank_res] == [x["losses"] for x in results[0]]


def test_the_comparison_fails_closed():
    one = torch.ones(3)
    assert _rel(one, one) == 0 and _rel(one * (1 + 2e-4), one) > 1
    assert _rel(torch.tensor([1.0, float("nan"), 1.0]), one) == float("inf")
    assert _rel(one, torch.tensor([1.0, float("inf"), 1.0])) == float("inf")
    assert _rel(torch.ones(2), one) == float("inf")  # a shape mismatch is no match
    case = {"id": "c", "steps": 2}
    good = {"case": "c", "steps": 2, "loss": 0.5, "grad": 0.5, "grad_name": "w", "param": 0.5, "param_name": "w",
            "losses": []}
    _check([[good], [good]], [case])
    for broken in ({**good, "param": float("nan")}, {**good, "loss": 3.0}, {**good, "steps": 1}):
        with pytest.raises(AssertionError):
            _check([[broken], [broken]], [case])
    with pytest.raises(AssertionError):  # a case that never ran
        _check([[good], [good]], [case, {"id": "d", "steps": 2}])


# The proof (20 AdamW steps): the solver's own plan, forced rings (AG-ring on the column
# projections, RS-ring on the row ones) and forced P2x2 (only an axis of 4 holds a 2x2 grid),
# on meshes 4, 2x2 and 2, for both models.
PROOF_4 = [(m, f, mesh) for m in ("gpt-tiny", "llama-tiny")
           for f, meshes in [("solved", ("4", "2x2")), ("ag_rs", ("4", "2x2")), ("p2x2", ("4",))]
           for mesh in meshes]
PROOF_2 = [(m, f, "2") for m in ("gpt-tiny", "llama-tiny") for f in ("solved", "ag_rs")]
# every other family, a few steps each (SGD and AdamW alternating)
MATRIX_4 = [(m, f, mesh) for m in ("gpt-tiny", "llama-tiny")
            for f, meshes in [("megatron", ("4", "2x2")), ("megatron-sp", ("4", "2x2")), ("ag_ring", ("4", "2x2")), ("rs_ring", ("4", "2x2")),
                              ("dp", ("4", "2x2")), ("zero", ("4", "2x2")), ("zero-kept0", ("2x2",)), ("megatron-zero", ("2x2",)),
                              ("solved-budget", ("4", "2x2")),
                              ("solved-h100", ("4", "2x2"))]
            for mesh in meshes]
MATRIX_2 = [(m, f, "2") for m in ("gpt-tiny", "llama-tiny")
            for f in ("megatron", "megatron-sp", "ag_ring", "rs_ring", "dp", "zero", "megatron-zero", "solved-budget")]


def halves(matrix):
    """(the default run's cases, the slow run's): a checkerboard over (model, family, mesh),
    so the default run keeps every family, on both models and both meshes where a family
    has them, in about half the cases (the CI time budget), and ``-m slow`` runs the rest."""
    models_, families, meshes = ({c[k]: None for c in matrix} for k in range(3))
    index = [list(models_), list(families), list(meshes)]
    fast = [c for c in matrix if sum(index[k].index(c[k]) for k in range(3)) % 2 == 0]
    return fast, [c for c in matrix if c not in fast]


def one_per_family(matrix):
    """(the default run's cases, the slow run's): one case of each family, the families taking
    their models and meshes in turn, so the default run still has both models and both
    meshes; ``-m slow`` runs the rest."""
    families = list({c[1]: None for c in matrix})
    fast = []
    for j, f in enumerate(families):
        cands = [c for c in matrix if c[1] == f]
        fast.append(cands[j % len(cands)])
    return fast, [c for c in matrix if c not in fast]


def split(world, matrix, name, pick=halves, slow=False):
    """``pytest.param`` pair of one matrix: its default part (``pick``; with ``slow``, in the
    slow run too) and the slow rest."""
    fast, rest = pick(matrix)
    return [pytest.param(world, fast, id=name, marks=[pytest.mark.slow] if slow else []),
            pytest.param(world, rest, id=f"{name}-rest", marks=pytest.mark.slow)]


def test_the_default_half_keeps_every_family_and_the_slow_half_the_rest():
    for matrix in (PROOF_4, PROOF_2, MATRIX_4, MATRIX_2):
        fast, rest = halves(matrix)
        assert sorted(fast + rest) == sorted(matrix) and not set(fast) & set(rest)
        assert {f for _, f, _ in fast} == {f for _, f, _ in matrix}      # every family
        assert len(fast) <= (len(matrix) + 1) // 2 + 1
    fast, _ = halves(MATRIX_4)
    assert {m for m, _, _ in fast} == {"gpt-tiny", "llama-tiny"} and {x for _, _, x in fast} == {"4", "2x2"}
    fast, rest = one_per_family(MATRIX_4)
    assert sorted(fast + rest) == sorted(MATRIX_4) and len(fast) == len({f for _, f, _ in MATRIX_4})
    assert {f for _, f, _ in fast} == {f for _, f, _ in MATRIX_4}
    assert {m for m, _, _ in fast} == {"gpt-tiny", "llama-tiny"} and {x for _, _, x in fast} == {"4", "2x2"}


# (the 4-rank halves run in the slow suite: the 2-rank halves keep every family in the default
# run, under its 25 minutes on CI's machine; the other 4-rank parity tests stay)
@pytest.mark.parametrize("world,matrix", split(4, PROOF_4, "4ranks", slow=True) + split(2, PROOF_2, "2ranks"))
def test_twenty_adamw_steps_match_single_device(world, matrix):
    cases = [_case(m, f, mesh, steps=20, opt="adamw") for m, f, mesh in matrix]
    _check(spawn(run_cases, world, cases, timeout_s=590), cases)


# Each family with its layers recomputed in backward (``passes.recompute``): the replay
# reruns the span's ops and collectives on the same inputs, so the tolerance is the one above.
RECOMPUTE_4 = [("gpt-tiny", "megatron+recompute", "4"), ("llama-tiny", "megatron-zero+recompute", "2x2"),
               ("llama-tiny", "ag_rs+recompute", "2x2"), ("gpt-tiny", "p2x2+recompute", "4"),
               ("llama-tiny", "zero+recompute", "4"), ("gpt-tiny", "dp+recompute", "2x2"),
               ("llama-tiny", "solved+recompute", "4")]
# Selective recomputation (``Hints.recompute == "selective"``): the replay reruns all but the
# kept matmuls and attentions, whose outputs come from the checkpoint's cache.
SELECTIVE_4 = [("gpt-tiny", "megatron+selective", "4"), ("llama-tiny", "dp+selective", "2x2"),
               ("llama-tiny", "zero+selective", "4"), ("gpt-tiny", "p2x2+selective", "4")]
# Only the first of the two layers recomputed (``Hints.recompute_layers``): the second runs as
# without recomputation, tied apart from the first (its own strategies).
PARTIAL_4 = [("gpt-tiny", "megatron+recompute1", "4"), ("llama-tiny", "solved+selective1", "2x2"),
             ("llama-tiny", "ag_rs+recompute1", "2x2")]
# (the default run: one case of each kind, in one spawn, where three spawns of two cases took
# 103 s of its 25 minutes; Megatron's full and selective replays also run through torch.compile
# in test_torch_compile_backends_match_single_device)
RECOMPUTED_DEFAULT = [RECOMPUTE_4[2], SELECTIVE_4[0], PARTIAL_4[1]]
# the plan's stats each family's suffix asks for: (recompute, recompute_layers)
RECOMPUTE_KIND = {"recompute": ("full", None), "selective": ("selective", None), "recompute1": ("full", 1),
                  "selective1": ("selective", 1)}


@pytest.mark.parametrize("matrix", [
    pytest.param(RECOMPUTED_DEFAULT, id="default"),
    pytest.param([c for c in RECOMPUTE_4 + SELECTIVE_4 + PARTIAL_4 if c not in RECOMPUTED_DEFAULT], id="rest",
                 marks=pytest.mark.slow)])
def test_recomputed_layers_match_single_device(matrix):
    cases = [_case(m, f, mesh, steps=20, opt="adamw") for m, f, mesh in matrix]
    for (_, family, _), c in zip(matrix, cases):
        stats = Plan.from_json(c["plan"]).stats
        level, layers = RECOMPUTE_KIND[family.rsplit("+", 1)[1]]
        assert (stats["recompute"], stats.get("recompute_layers")) == (level, layers), (c["id"], stats)
        assert level == "full" or stats["recompute_kept"], c["id"]  # selective: something is kept
    _check(spawn(run_cases, 4, cases, timeout_s=590), cases)


@pytest.mark.parametrize("pairs", [
    pytest.param((("llama-tiny", "solved-budget"),), id="default"),
    pytest.param((("gpt-tiny", "megatron"), ("llama-tiny", "megatron"), ("gpt-tiny", "solved-budget")), id="rest",
                 marks=pytest.mark.slow)])
def test_odd_shapes_match_single_device(pairs):
    """Batch 3 and sequence 7 divide no mesh axis: the plans split heads and hidden dims
    (Megatron's layout, and the solver's own under a budget that forces it to shard)."""
    cases = []
    for m, family in pairs:
        plan = make_plan(m, "4", family, 3, 7)
        assert any(t != "R" for n in plan.nodes.values() if n.role == "param" for t in n.out), (m, family)
        cases.append(dict(id=f"{m}/{family}/4/odd", model=m, overrides={}, plan=plan.to_json(), batch=3,
                          seq=7, steps=20, opt="adamw"))
    _check(spawn(run_cases, 4, cases, timeout_s=590), cases)


@pytest.mark.parametrize("world,matrix", split(4, MATRIX_4, "4ranks", one_per_family, slow=True)
                         + split(2, MATRIX_2, "2ranks"))
def test_every_family_matches_single_device(world, matrix):
    # every listed case plans (a forced family this mesh cannot run would fail here, not
    # drop out of the proof unseen)
    cases = [_case(m, f, mesh, opt="adamw" if i % 2 else "sgd") for i, (m, f, mesh) in enumerate(matrix)]
    _check(spawn(run_cases, world, cases, timeout_s=590), cases)


# BLOOM's decoder (gpt-tiny with ALiBi in place of the position table and a LayerNorm right
# after the embedding): each device adds the ALiBi bias of the heads it holds, and the
# embedding's norm runs on whatever split its input arrives in. Every family the benches
# run (the presets' layouts among them: TorchTitan's FSDP + TP+SP with TP outer, Megatron's
# distributed optimizer), 6 AdamW steps each; the default run keeps one case.
BLOOM = {"position": "alibi", "embed_norm": True}
BLOOM_4 = [("megatron", "4"), ("megatron-sp", "2x2"), ("megatron-zero", "2x2"), ("fsdp-tp-outer", "2x2"),
           ("ag_rs", "4"), ("rs_ring", "2x2"), ("p2x2", "4"), ("dp", "4"), ("zero", "2x2"), ("solved", "4")]
BLOOM_DEFAULT = [("ag_rs", "2")]


@pytest.mark.parametrize("world,matrix", [pytest.param(2, BLOOM_DEFAULT, id="default"),
                                          pytest.param(4, BLOOM_4, id="4ranks", marks=pytest.mark.slow)])
def test_a_bloom_decoder_matches_single_device(world, matrix):
    with torch.device("meta"):  # the variant is BLOOM's: no position table, a norm after the embedding
        names = {n for n, _ in models.build("gpt-tiny", **BLOOM).named_parameters()}
    assert "wpe.weight" not in names and "ln_emb.weight" in names, sorted(names)
    cases = [_case("gpt-tiny", f, mesh, steps=6, overrides=BLOOM, label="bloom-tiny") for f, mesh in matrix]
    _check(spawn(run_cases, world, cases, timeout_s=590), cases)


def test_a_view_reads_its_input_resharded_to_a_layout_it_can_keep():
    # P(2x2) logits [B, S, V] are split over (S, V) in a grid (every linear forced to P(2x2)
    # with sequence rows: with batch rows, the solver's own choice, the reshape keeps the
    # grid); the loss's reshape to [B*S, V] cannot keep that split (it merges B with a
    # split S). With a vocabulary large enough for the bytes to matter, the planner
    # reshards the logits to a batch split, which the reshape keeps, instead of gathering
    # them whole: the loss runs on a quarter of the rows.
    overrides = {"bias": False, "vocab": 4096}
    plan = make_plan("gpt-tiny", "4", "p2x2-seq-rows", B, S, **overrides)
    via = {k: v.ins for k, v in plan.nodes.items() if v.role == "follower" and v.ins}
    assert list(via.values()) == [[["S0"]]], via
    cases = [dict(id="gpt-tiny-v4096/p2x2/4", model="gpt-tiny", overrides=overrides, plan=plan.to_json(),
                  batch=B, seq=S, steps=3, opt="adamw")]
    _check(spawn(run_cases, 4, cases, timeout_s=600), cases)


# (inductor's CPU code generation, 80 s here, in the slow suite; the default run keeps it in
# test_weights_split_over_both_axes_match_through_their_joint_gather)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_backends_match_single_device(backend):
    """The same program through torch.compile: functional collectives, the ring custom ops and
    ZeRO's coalesced parameter gathers traced (no graph break at any of them: reading an
    autograd node's ``grad_fn`` while tracing broke the graph 7 times and, under inductor,
    gave wrong gradients), inductor generating the CPU kernels; recomputed layers traced as
    checkpoint regions (the eager path's early-stop switch broke the graph there), selectively
    recomputed ones with their policy (a ``functools.partial`` dynamo takes as a constant)."""
    cases = [{**_case("llama-tiny", family, "2", steps=3), "backend": backend,
              "id": f"llama-tiny/{family}/2/{backend}"}
             for family in ("ag_rs", "zero", "megatron+recompute", "megatron+selective")]
    results = spawn(run_cases, 2, cases, timeout_s=590)
    _check(results, cases)
    assert all(c["graph_breaks"] == 0 for r in results for c in r), [[c["graph_breaks"] for c in r] for r in results]


def test_weights_split_over_both_axes_match_through_their_joint_gather():
    """ZeRO on 2x2: every weight split on one dim over both axes and gathered whole once over
    the axes' joint group (``prefetch_params.join_chains``), whose rank order must be the
    order DTensor lays the chunks out in, eager and through inductor (the joint group's name
    traced like any other)."""
    cases = [{**_case("llama-tiny", "zero", "2x2", steps=3), "backend": backend,
              "id": f"llama-tiny/zero/2x2/{backend or 'eager'}"} for backend in (None, "inductor")]
    results = spawn(run_cases, 4, cases, timeout_s=590)
    _check(results, cases)
    assert all(c["graph_breaks"] == 0 for r in results for c in r[1:]), [[c.get("graph_breaks") for c in r] for r in results]


def test_a_split_re_cut_over_both_axes_matches_single_device():
    """FSDP + TP+SP on 2x2 with TP on the outer axis (the fidelity bench's fsdp-tp layout),
    the loss splitting rows on both axes: the logits (vocab on the outer axis, rows on the
    inner) reach it in one redistribution over the joint group, and its backward, the reverse
    exchange, hands the head its gradient: 20 AdamW steps match the single-device model."""
    cases = [_case("gpt-tiny", "fsdp-tp-outer", "2x2", steps=20)]
    results = spawn(run_cases, 4, cases, timeout_s=590)
    _check(results, cases)
    assert all("redistribute" in r[0]["joint_ops"] for r in results), [r[0]["joint_ops"] for r in results]


def test_zero_with_the_positions_looked_up_whole_matches_single_device():
    """Data parallel with the distributed optimizer (ZeRO-2) on 4, GPT's position embedding
    gathered whole and looked up on every rank before batch-split work reads it (the plan the
    VM's calibrated profile picks for gpt-50m's megatron dp 4 x tp 1): the weight's gradient is
    made complete by the f ahead of the gather's slice, not summed as slices by the reducer
    (which added different rows together: the loss drifted from the second step on)."""
    cases = [_case("gpt-tiny", "megatron-zero-whole-positions", "4", steps=6)]
    results = spawn(run_cases, 4, cases, timeout_s=590)
    _check(results, cases)


# --------------------------------------------------------------------------- rank agreement, dumps


def _disagree(rank, world, plans):
    import torch

    import stpc
    from stpc import models
    from stpc.planner import Plan
    from stpc.runtime import PlanMismatch

    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    ex = models.example_inputs("gpt-tiny", B, S, device="cpu")
    try:
        stpc.compile(model, (world,), ex, plan=Plan.from_json(plans[rank]))
    except PlanMismatch as e:
        return str(e)
    return None


def test_ranks_with_different_plans_refuse_to_run():
    a = make_plan("gpt-tiny", "2", "dp", B, S).to_json()
    b = make_plan("gpt-tiny", "2", "megatron", B, S).to_json()
    msgs = spawn(_disagree, 2, [a, b], timeout_s=120)
    assert all(m is not None and "ranks [1]" in m for m in msgs), msgs


def _dump(rank, world, plan_json, directory):
    import torch

    import stpc
    from stpc import models
    from stpc.planner import Plan

    torch.manual_seed(0)
    model = models.build("llama-tiny")
    ex = models.example_inputs("llama-tiny", B, S, device="cpu")
    dm = stpc.compile(model, (world,), ex, plan=Plan.from_json(plan_json))
    return dm.stpc.dump_passes(directory) if rank == 0 else []


def test_dump_after_each_pass(tmp_path):
    plan = make_plan("llama-tiny", "2", "ag_rs", B, S).to_json()
    paths = spawn(_dump, 2, plan, str(tmp_path), timeout_s=120)[0]
    names = [os.path.basename(p) for p in paths if p.endswith(".txt")]
    assert names == ["00_traced.txt", "01_shard_params.txt", "02_insert_collectives.txt",
                     "03_ring_decompose.txt", "04_cleanup.txt", "05_defer_grad_sync.txt", "06_recompute.txt",
                     "07_prefetch_params.txt", "08_issue_early.txt", "09_verify.txt", "10_read_params_at_use.txt"]
    text = open(tmp_path / "02_insert_collectives.txt").read()
    assert "all_gather" in text and "<all_gather@axis0" in text
    final = open(tmp_path / "10_read_params_at_use.txt").read()
    assert "ring_allgather_matmul" in final and "ring_matmul_reducescatter" in final and "read_param" in final


# --------------------------------------------------------------------------- the shape contract


def _other_batch(rank, world, plan_json):
    import copy

    import torch

    import stpc
    from stpc import models
    from stpc.planner import Plan

    torch.manual_seed(0)
    model, strict = models.build("gpt-tiny"), models.build("gpt-tiny")
    single = copy.deepcopy(model)
    ex = models.example_inputs("gpt-tiny", B, S, device="cpu")
    pm = stpc.compile(model, (world,), ex, plan=Plan.from_json(plan_json))
    only_one = stpc.compile(strict, (world,), ex, plan=Plan.from_json(plan_json), max_plans=1)
    idx, tgt = models.example_inputs("gpt-tiny", B + 1, S, device="cpu")
    try:
        only_one(idx, tgt)
        refused = None
    except stpc.ShapeMismatch as e:
        refused = str(e)
    loss = pm(idx, tgt)  # planned anew for batch 5 (which 2 ranks cannot split on the batch)
    loss.backward()
    ref = single(idx, tgt)
    ref.backward()
    grads = full_grads(pm)
    worst = max(_rel(grads[k], p.grad) for k, p in single.named_parameters())
    # both shapes compiled now; ranks called with different ones (each compiled) must not run
    # their programs against each other: every rank refuses, before any communication
    try:
        pm(*(ex if rank == 0 else (idx, tgt)))
        diverged = None
    except stpc.ShapeMismatch as e:
        diverged = str(e)
    return refused, _rel(loss.detach(), ref.detach()), worst, len(pm.stpc.programs), diverged


def test_a_call_with_other_shapes_is_planned_or_refused_never_sliced():
    """Compiled at batch 4 on 2 ranks, called at batch 5 (it used to drop a row and return a
    loss): with room for one plan every rank refuses, naming both shapes; by default the
    new shape is planned (every rank agreeing) and matches one device."""
    plan = make_plan("gpt-tiny", "2", "dp", B, S).to_json()
    for rank, (refused, loss_err, grad_err, programs, diverged) in enumerate(spawn(_other_batch, 2, plan,
                                                                                  timeout_s=300)):
        assert refused and f"shape {(B + 1, S)}" in refused and f"shape {(B, S)}" in refused, refused
        assert loss_err <= 1 and grad_err <= 1 and programs == 2
        assert diverged and "different input signatures" in diverged, diverged
        assert f"shape {(B + rank, S)}" in diverged  # each rank names what it was called with


def test_an_uneven_split_is_an_error():
    from stpc.runtime import shard_tensor

    assert shard_tensor(torch.arange(8).view(4, 2), ("S0",), (2,), (1,)).tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"5 is not a multiple of 2"):
        shard_tensor(torch.zeros(5, 2), ("S0",), (2,), (0,))


def _unseeded(rank, world, plan_json, extra=False):
    import torch

    import stpc
    from stpc import models
    from stpc.planner import Plan
    from stpc.runtime import TensorMismatch

    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    if rank == 1 and extra:  # rank 1 built a model with one more buffer
        model.register_buffer("stray", torch.zeros(3))
    elif rank == 1:  # as if rank 1 had initialised without the seed
        with torch.no_grad():
            model.layers[0].mlp.fc1.weight.add_(1e-3)
    try:
        stpc.compile(model, (world,), models.example_inputs("gpt-tiny", B, S, device="cpu"),
                     plan=Plan.from_json(plan_json))
    except TensorMismatch as e:
        return str(e)
    return None


def test_ranks_with_different_weights_refuse_to_run():
    plan = make_plan("gpt-tiny", "2", "dp", B, S).to_json()
    msgs = spawn(_unseeded, 2, plan, timeout_s=120)
    assert all(m and "layers.0.mlp.fc1.weight (ranks [1])" in m and "wte.weight" not in m for m in msgs), msgs
    msgs = spawn(_unseeded, 2, plan, True, timeout_s=120)
    assert all(m and "ranks [1] hold a different set of weights" in m for m in msgs), msgs
