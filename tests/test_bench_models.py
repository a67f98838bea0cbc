"""The model benchmarks (``python -m stpc bench primepar|planner|kernel``): their helpers, and
each verb on a tiny size (one model cut to 2 layers, one device count, one cluster)."""
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stpc.cli.bench import BENCHES, machine_line, main_bench, write_section
from stpc.cli.bench_kernel import main_kernel, ring_step_shapes, step_gemms
from stpc.cli.bench_planner import large_target, main_planner, primepar_search_s, row
from stpc.cli.bench_primepar import (best_fitting, compare, greatest_fitting_depth, inter_node_gbs, main_primepar,
                                     p2x2_line, p2x2_modules, p2x2_probe, p2x2_reasons, parse_target, recompute_line,
                                     unproven_line, why, with_inter_node, cell_at_bandwidth)
from stpc.cost_models import get_cluster

TINY = ["--models", "llama2-7b", "--layers", "2", "--sizes", "4"]


def test_help_lists_every_bench(capsys):
    assert main_bench(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("runtime", "fidelity", "primepar", "planner", "kernel"):
        assert name in BENCHES and name in out


@pytest.mark.parametrize("limit", [1, 2, 23, 24, 95, 96])
def test_depth_search_finds_the_greatest_fitting_depth(limit):
    probed = []

    def fits(depth):
        probed.append(depth)
        return depth <= limit

    assert greatest_fitting_depth(fits, 96) == limit
    assert len(probed) <= 8   # binary search: full depth, then log2(96) probes


def test_depth_search_none_when_one_layer_does_not_fit():
    assert greatest_fitting_depth(lambda d: False, 80) is None
    assert greatest_fitting_depth(lambda d: True, 1) == 1


def _rec(step, peak=10.0, fits=True):
    return {"fits": fits, "step_s": step, "peak_bytes": peak} if fits else {"fits": False, "min_budget_bytes": 1e12}


def test_speedup_is_against_the_best_fitting_baseline():
    # the fastest baseline does not fit: it must not be the reference
    baselines = {"megatron": _rec(2.0, peak=20.0), "fsdp-tp": _rec(None, fits=False), "spatial": _rec(1.6, peak=16.0)}
    cell = compare({"stpc": _rec(1.0, peak=8.0), "baselines": baselines})
    assert best_fitting(baselines) == "spatial"
    assert cell["best_baseline"] == "spatial"
    assert cell["speedup"] == pytest.approx(1.6)
    assert cell["memory_ratio"] == pytest.approx(0.5)
    none = compare({"stpc": _rec(1.0), "baselines": {"megatron": _rec(None, fits=False)}})
    assert none["best_baseline"] is None and none["speedup"] is None


def test_why_says_what_makes_the_difference():
    def cell(speedup, families, best="spatial", layout="mesh 4x8"):
        stpc = {"fits": True, "families": families, "hidden_s": 0.25, "layout": layout}
        return {"stpc": stpc, "best_baseline": best, "speedup": speedup}
    assert "ag_ring, rs_ring on 12 ops" in why(cell(1.1, {"spatial": 30, "ag_ring": 8, "rs_ring": 4}))
    assert "no temporal family pays" in why(cell(1.0, {"spatial": 30}))
    assert "outside megatron's space (mesh 2x2x8" in why(cell(1.2, {"spatial": 30}, "megatron", "mesh 2x2x8"))
    assert "outside stpc's own space" in why(cell(0.9, {"spatial": 30}, "megatron"))
    assert why({"stpc": {"fits": False}, "best_baseline": None, "speedup": None}) == "-"


def test_inter_node_bandwidth_is_per_node_split_over_its_devices():
    cl = get_cluster("primepar-v100")
    slow = with_inter_node(cl, 12.5)
    assert slow.inter.bw_bytes_per_s == pytest.approx(12.5e9 / cl.devices_per_node)
    assert inter_node_gbs(slow) == pytest.approx(12.5)
    assert slow.intra == cl.intra and slow.nodes == cl.nodes and "12.5 GB/s" in slow.name


def test_primepar_tiny(tmp_path, capsys):
    results, out = tmp_path / "RESULTS.md", tmp_path / "pp.json"
    argv = [*TINY, "--clusters", "primepar-v100:fp16", "--json", str(out), "--results", str(results)]
    assert main_primepar(argv, machine_line, write_section) == 0
    text = results.read_text()
    assert text.startswith("<!-- bench:primepar -->") and "<!-- /bench:primepar -->" in text
    for column in ("layers", "stpc layout", "stpc families", "stpc step s", "stpc peak GiB", "compute s",
                   "exposed comm s", "hidden comm s", "megatron layout", "fsdp-tp layout", "spatial layout",
                   "speedup vs best fitting baseline (modelled)", "memory stpc / best baseline", "machine:",
                   "Geo-mean speedup", "against the megatron baseline alone", "1.30x", "REFERENCES.md",
                   "Sensitivity", "modelled", "Recomputation of the layers: stpc's plan",
                   "P(2x2) on the MLP's down projection"):
        assert column in text, column
    data = json.loads(out.read_text())
    assert len(data["cells"]) == 1 and len(data["sensitivity"]) == 2
    cell = data["cells"][0]
    assert cell["layers"] == 2 and not cell["reduced"] and cell["stpc"]["fits"]
    assert "available" in cell["stpc"]["p2x2"]
    fitting = {b: r["step_s"] for b, r in cell["baselines"].items() if r["fits"]}
    assert cell["best_baseline"] == min(fitting, key=fitting.get)
    assert cell["speedup"] == pytest.approx(fitting[cell["best_baseline"]] / cell["stpc"]["step_s"])
    assert {r["inter_node_gbs_per_node"] for r in data["sensitivity"]} == {12.5, 100.0}


def test_primepar_jobs_plan_the_same_cells(tmp_path):
    # two (model, cluster) pairs planned in two processes: the same cells, in the same order,
    # as one process plans them (times aside)
    argv = ["--models", "llama2-7b", "opt-6.7b", "--layers", "1", "--sizes", "4", "--clusters", "primepar-v100:fp16",
            "--baselines", "megatron", "--inter-node-gbs", "--quiet"]
    got = {}
    for jobs in (1, 2):
        out = tmp_path / f"pp{jobs}.json"
        assert main_primepar([*argv, "--jobs", str(jobs), "--json", str(out)], machine_line, write_section) == 0
        got[jobs] = json.loads(out.read_text())

    def planned(cell):
        return {k: v for k, v in cell.items() if k not in ("wall_s", "search_s")} | {
            "stpc": {k: v for k, v in cell["stpc"].items() if k != "search_s"},
            "baselines": {b: {k: v for k, v in r.items() if k != "search_s"} for b, r in cell["baselines"].items()}}

    assert [c["model"] for c in got[2]["cells"]] == ["llama2-7b", "opt-6.7b"]
    assert [planned(c) for c in got[2]["cells"]] == [planned(c) for c in got[1]["cells"]]
    assert got[2]["config"]["jobs"] == 2


def test_primepar_checkpoint_resumes_a_stopped_run(tmp_path):
    # a run of one model writes its jobs (its cells, each sensitivity cell) as they finish; a
    # later run of two models takes those from the file (the same cells) and plans only the other
    ck = tmp_path / "pp.jsonl"
    base = ["--layers", "1", "--sizes", "4", "--clusters", "primepar-v100:fp16", "--baselines", "megatron",
            "--inter-node-gbs", "12.5", "--checkpoint", str(ck), "--quiet"]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main_primepar(["--models", "llama2-7b", *base, "--json", str(first)], machine_line, write_section) == 0
    lines = ck.read_text().splitlines()
    assert [json.loads(x)["key"]["kind"] for x in lines] == ["cells", "sensitivity"]
    with open(ck, "a") as f:
        f.write('{"key": {"kind": "cel')   # a line cut short by a killed run
    results = tmp_path / "RESULTS.md"
    argv = ["--models", "llama2-7b", "opt-6.7b", *base, "--sensitivity-models", "llama2-7b", "--json", str(second),
            "--results", str(results)]
    assert main_primepar(argv, machine_line, write_section) == 0
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert [c["model"] for c in b["cells"]] == ["llama2-7b", "opt-6.7b"]
    assert b["cells"][0] == a["cells"][0] and b["sensitivity"] == a["sensitivity"]   # taken, not re-planned
    assert b["provenance"]["taken"] == 2 and b["provenance"]["planned"] == 1
    assert len(ck.read_text().splitlines()) == 4   # the cut line, then opt-6.7b's cells appended
    text = results.read_text()
    assert "2 of 3 jobs were taken from the checkpoint" in text and "Planned by stpc " in text


def test_primepar_jobs_checkpoint_each_job_as_it_finishes(tmp_path):
    ck = tmp_path / "pp.jsonl"
    argv = ["--models", "llama2-7b", "opt-6.7b", "--layers", "1", "--sizes", "4", "--clusters", "primepar-v100:fp16",
            "--baselines", "megatron", "--inter-node-gbs", "12.5", "--sensitivity-models", "opt-6.7b",
            "--jobs", "2", "--checkpoint", str(ck), "--json", str(tmp_path / "pp.json"), "--quiet"]
    assert main_primepar(argv, machine_line, write_section) == 0
    keys = [json.loads(x)["key"] for x in ck.read_text().splitlines()]
    assert sorted((k["kind"], k["model"]) for k in keys) == [("cells", "llama2-7b"), ("cells", "opt-6.7b"),
                                                             ("sensitivity", "opt-6.7b")]
    assert keys.index(next(k for k in keys if k["kind"] == "sensitivity")) > keys.index(
        next(k for k in keys if k["model"] == "opt-6.7b"))   # after the cell it re-plans
    data = json.loads((tmp_path / "pp.json").read_text())
    assert [r["model"] for r in data["sensitivity"]] == ["opt-6.7b"]


def test_primepar_sigterm_ends_the_workers_too(tmp_path):
    # a stopped run (kill's SIGTERM) leaves no worker planning on; what finished is on disk
    ck = tmp_path / "pp.jsonl"
    cmd = [sys.executable, "-m", "stpc", "bench", "primepar", "--models", "opt-175b", "bloom-176b", "llama2-70b",
           "--sizes", "8", "16", "32", "--jobs", "2", "--checkpoint", str(ck), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        workers = _children(proc.pid)
        assert len(workers) >= 2, "the pool's workers never started"
        time.sleep(3)   # (planning)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_recompute_line_names_each_level_per_plan():
    cells = [{"model": m, "devices": n, "stpc": {"fits": True, "recompute": r},
              "baselines": {"megatron": {"fits": fits, "recompute": "full"}}}
             for m, n, r, fits in (("a", 4, "selective", True), ("b", 8, "full", False), ("c", 8, "none", True))]
    (line, _) = recompute_line(cells, ["megatron"])
    assert line == ("Recomputation of the layers: stpc's plan selective in 1 (a on 4); full in 1 (b on 8); none in "
                    "the other cells. megatron: selective in 0; full in 2 (a on 4, c on 8).")


def test_the_p2x2_probe_prices_p2x2_on_the_down_projection_of_stpcs_own_plan():
    import stpc
    from stpc import models
    from stpc.planner import Hints, search

    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = stpc.trace(m, models.example_inputs("gpt-tiny", 8, 32))
    own = search(tg, (4,), "cpu-local")
    probe = p2x2_probe(own)
    assert probe["available"] and own.nodes[probe["node"]].module == "layers.0.mlp.fc2"
    assert not probe["chosen"] and probe["ratio"] >= 1 - 1e-9  # (the plan is the optimum: P2x2 costs no less)
    forced = search(tg, (4,), "cpu-local", hints=Hints(force=[(r"fc2$", lambda s: s.kind == "p2x2")]))
    assert forced.modelled_step_time_s == pytest.approx(probe["step_s"])  # (the same re-solve, from either side)
    assert p2x2_probe(forced) == {"available": True, "node": probe["node"], "chosen": True}
    assert p2x2_modules(forced) == ["layers.*.mlp.fc2"] and p2x2_modules(own) == []   # (every layer's, folded)
    # why: the forced plan leaves fc2 no other strategy to compare with; stpc's own runs none
    assert p2x2_reasons(forced) == [{"module": "layers.*.mlp.fc2", "next": None, "ratio": None, "how": "none fits"}]
    assert p2x2_reasons(own) == []
    assert p2x2_probe(search(tg, (2,), "cpu-local")) == {"available": False}


def test_p2x2_line_says_per_cell_what_p2x2_costs_or_why_it_is_not_there():
    def cell(model, n, probe):
        return {"model": model, "devices": n, "infeasible": False, "stpc": {"fits": True, "p2x2": probe}}
    cells = [cell("a", 4, {"available": True, "node": "linear_5", "chosen": False, "step_s": 1.1, "ratio": 1.1}),
             cell("b", 8, {"available": False}),
             cell("c", 16, {"available": True, "node": "linear_5", "chosen": True}),
             cell("d", 16, {"available": True, "node": "linear_5", "chosen": False, "step_s": 1.0, "ratio": 1.02}),
             cell("e", 4, {"available": True, "node": "linear_5", "chosen": False, "step_s": 0.9, "ratio": 0.9,
                           "peak_bytes": 3 * 2**30})]
    cells[-1]["budget_bytes"] = 2 * 2**30
    cells[2]["stpc"]["p2x2_modules"] = ["layers.*.mlp.fc2", "lm_head"]
    (line, _) = p2x2_line(cells)
    assert line.endswith("slower by +2.0% in d on 16, +10.0% in a on 4; faster but over the budget by 10.0% in e on "
                         "4 (peak 3.0 GiB, budget 2.0); chosen in c on 16; not possible in 1 (no mesh axis of 4^k "
                         "devices in stpc's shape): b on 8. The ops stpc's own plans run P(2x2): layers.*.mlp.fc2, "
                         "lm_head in c on 16.")
    # a cell that recorded why (p2x2_reasons) says it, op by op
    cells[2]["stpc"]["p2x2_why"] = [{"module": "lm_head", "next": "(R)·(S0) -> (S1)", "ratio": 1.0001, "how": "exact"},
                                    {"module": "layers.*.mlp.fc2", "next": None, "ratio": None, "how": "none fits"}]
    (line, _) = p2x2_line(cells)
    assert line.endswith("The ops stpc's own plans run P(2x2): lm_head in c on 16 (the best plan with it "
                         "(R)·(S0) -> (S1) is +0.01%), layers.*.mlp.fc2 in c on 16 (no other strategy of it fits "
                         "the budget).")
    assert p2x2_line([]) == []


def test_unproven_line_names_each_plan_not_proven_optimal():
    proven = {"fits": True, "optimal": True, "unresolved": []}
    cells = [{"model": "a", "devices": 4, "stpc": proven, "baselines": {"megatron": proven}}]
    assert unproven_line(cells, ["megatron"]) == []
    cells.append({"model": "b", "devices": 8,
                  "stpc": {"fits": True, "optimal": False, "unresolved": ["mesh 4x2", "mesh 2x2x2"]},
                  "baselines": {"megatron": {"fits": True, "optimal": False, "unresolved": []},
                                "fsdp-tp": {"fits": False}}})
    (line, _) = unproven_line(cells, ["megatron", "fsdp-tp"])
    assert line.endswith(": stpc's plan for b on 8 (CP-SAT ran out of time on mesh 4x2, mesh 2x2x2); megatron's plan for b on 8 "
                         "(its own CP-SAT solve stopped at the time limit).")
    # a sensitivity cell is named by its bandwidth (its device count is every such cell's)
    for c, g in zip(cells, (12.5, 100.0)):
        c["inter_node_gbs_per_node"] = g
    (line, _) = unproven_line(cells, ["megatron"], where=cell_at_bandwidth)
    assert line.endswith(": stpc's plan for b at 100 GB/s per node (CP-SAT ran out of time on mesh 4x2, mesh 2x2x2); "
                         "megatron's plan for b at 100 GB/s per node (its own CP-SAT solve stopped at the time limit).")


REPO = Path(__file__).resolve().parent.parent
KEPT_CHECKPOINT = REPO / "benchmarks" / "data" / "primepar_checkpoint_s48.jsonl"


def _section_body(text: str) -> list[str]:
    """A primepar section's lines but those that name the run (its command, machine and date,
    wall time, and which checkpoint and code gave its jobs)."""
    body = text[text.index("<!-- bench:primepar -->"):text.index("<!-- /bench:primepar -->")]
    skip = ("Command:", "machine:", "Wall time of this run:", "Planned by stpc")
    return [line for line in body.splitlines() if not line.startswith(skip)]


def test_results_primepar_section_is_its_kept_checkpoint_rendered(tmp_path):
    # RESULTS.md's primepar section is what its run's checkpoint, kept in benchmarks/data,
    # renders: every job taken from it (nothing planned), every table row and sentence the same
    ck = tmp_path / "pp.jsonl"
    shutil.copy(KEPT_CHECKPOINT, ck)
    results, out = tmp_path / "RESULTS.md", tmp_path / "pp.json"
    assert main_primepar(["--checkpoint", str(ck), "--json", str(out), "--results", str(results), "-q"],
                         machine_line, write_section) == 0
    assert ck.read_bytes() == KEPT_CHECKPOINT.read_bytes()  # no job was planned again
    rendered = results.read_text()
    assert "25 of 25 jobs were taken from the checkpoint" in rendered
    assert _section_body(rendered) == _section_body((REPO / "benchmarks" / "RESULTS.md").read_text())
    # the sensitivity cells say which plans were not proven optimal, by their bandwidth
    sensitivity = rendered[rendered.index("### Sensitivity"):rendered.index("### PrimePar's worked example")]
    assert re.search(r"stpc's plan for llama2-70b at [\d.]+ GB/s per node \(CP-SAT ran out of time on", sensitivity)


@pytest.mark.slow  # (221 s in CI when every depth tried was planned; now each is a fits_budget proof, and
# the plans at the depth found still take CP-SAT minutes; the depth search itself is held by the
# test_depth_search_* tests in the default run, fits_budget by tests/test_fits_budget.py)
def test_primepar_reduces_depth_when_no_baseline_fits(tmp_path):
    out = tmp_path / "pp.json"
    # 4 layers of llama2-7b on 4 devices need more than 5 GiB per device under every baseline; 2 fit
    argv = [*TINY[:2], "--layers", "4", "--sizes", "4", "--clusters", "primepar-v100:fp16", "--budget-gib", "5",
            "--inter-node-gbs", "--json", str(out), "-q"]
    assert main_primepar(argv, machine_line, write_section) == 0
    cell = json.loads(out.read_text())["cells"][0]
    assert cell["reduced"] and 1 <= cell["layers"] < 4 and cell["full_layers"] == 4
    assert any(r["fits"] for r in cell["baselines"].values())


def test_planner_tiny(tmp_path, capsys):
    results, out = tmp_path / "RESULTS.md", tmp_path / "planner.json"
    argv = [*TINY, "--repeat", "2", "--large-model", "none", "--json", str(out), "--results", str(results)]
    assert main_planner(argv, machine_line, write_section) == 0
    text = results.read_text()
    assert "<!-- bench:planner -->" in text and "PrimePar search s (published)" in text
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1
    c = cells[0]
    assert c["reference_s"] == primepar_search_s("llama2-7b", 4)
    assert len(c["budgeted"]["searches_s"]) == 2 and c["total_s"] == pytest.approx(c["trace_s"] + c["first_search_s"])


def test_planner_row_says_when_a_plan_is_not_proven_optimal():
    r = {"model": "m", "devices": 8, "cluster": "c", "dtype": "fp16", "layers": 2, "trace_s": 1.0,
         "trace_cached": False, "first_search_s": 2.0, "search_s": 2.0, "total_s": 3.0, "reference_s": None,
         "budget_bytes": 2**30, "budgeted": {"fits": True, "mesh": [4, 2], "peak_bytes": 2**30, "optimal": True}}
    assert "not proven optimal" not in row(r)
    r["budgeted"]["optimal"] = False
    assert row(r).endswith("planned: mesh 4x2, peak 1.0 GiB, not proven optimal (CP-SAT time limit) |")


def test_large_target_grows_a_cluster_too_small():
    t, note = large_target("dgx-h100:bf16", 64)
    assert t.cluster.num_devices >= 64 and note is None
    t, note = large_target("dgx-h100:bf16", 256)
    assert t.cluster.num_devices == 256 and "nodes" in note


def test_parse_target_rejects_a_bad_entry():
    from stpc.cli._common import UsageError
    with pytest.raises(UsageError):
        parse_target("primepar-v100")
    with pytest.raises(UsageError):
        parse_target("no-such-cluster:fp16")


def test_ring_steps_split_one_linears_flops():
    t, d_in, d_out, p = 16384, 4096, 11008, 4
    for ring in ("ag_ring", "rs_ring"):
        flops = {m * k * n for _, m, k, n in step_gemms(ring, t, d_in, d_out, p)}
        assert flops == {t * d_in * d_out // p**2}   # each step: 1/P^2 of the linear's GEMM
    shapes = ring_step_shapes("llama2-7b", [4, 8], 8, 2048)
    assert {s["devices"] for s in shapes} == {4, 8}
    assert any("down_proj rs_ring forward" in u for s in shapes for u in s["uses"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernel is measured")
def test_kernel_without_cuda_says_not_measured(tmp_path):
    results, out = tmp_path / "RESULTS.md", tmp_path / "kernel.json"
    assert main_kernel(["--json", str(out), "--results", str(results), "-q"], machine_line, write_section) == 0
    text = results.read_text()
    assert "Not measured: no CUDA device" in text and "| 8 | 2048 | 4096 | 1376 |" in text
    data = json.loads(out.read_text())
    assert data["measured"] is False and len(data["shapes"]) > 0


@pytest.mark.parametrize("bench", ["primepar", "planner", "kernel"])
def test_surface_help_and_usage_errors(bench, capsys):
    from stpc.cli import main
    assert main(["bench", bench, "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m stpc bench " + bench in out and "--quiet" in out and "shared flags" in out
    bad_model = ["--model", "no-such-model"] if bench == "kernel" else ["--models", "no-such-model"]
    for argv in (["--no-such-flag"], bad_model):
        assert main(["bench", bench, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "Fix: " in err[0], err


def test_primepar_plans_its_worked_example_both_ways(tmp_path):
    # OPT-175B's fc2 on 8 devices: Megatron's {B, N, N} on 2x2x2 and PrimePar's {N, P2x2} on
    # 2x4, each the best plan with every layer's fc2 so (one layer, a small batch: quick)
    out, results = tmp_path / "pp.json", tmp_path / "RESULTS.md"
    argv = ["--models", "opt-175b", "--sizes", "8", "--layers", "1", "--batch", "2", "--seq", "64", "--clusters",
            "primepar-v100:fp16", "--inter-node-gbs", "--json", str(out), "--results", str(results), "-q",
            "--checkpoint", str(tmp_path / "pp.jsonl")]
    assert main_primepar(argv, machine_line, write_section) == 0
    ex = json.loads(out.read_text())["example"]
    assert ex["model"] == "opt-175b" and ex["devices"] == 8 and ex["layers"] == 1
    own, meg, pp, best_pp = ex["rows"]
    assert meg["mesh"] == "2x2x2" and meg["strategy"].startswith("(S0,S2,S2)") and meg["strategy"].endswith("(S0,P,P)")
    assert pp["mesh"] == "2x4" and pp["strategy"].startswith("p2x2@1 (S2,X1.2)")
    assert best_pp["strategy"].startswith("p2x2") and best_pp["step_s"] <= pp["step_s"]
    for r in ex["rows"]:  # each a plan's full effect: no better than stpc's own for the cell
        assert r["step_s"] >= own["step_s"] * (1 - 1e-9) and r["fc2_s"] > 0
    text = results.read_text()
    assert "PrimePar's worked example" in text and "{N, P2x2}" in text and "p2x2@1" in text
    # the example is a checkpoint's job too: a second run takes it (and the cell) and renders
    # the same section
    ck = tmp_path / "pp.jsonl"
    assert main_primepar(argv, machine_line, write_section) == 0
    assert json.loads(out.read_text())["provenance"]["taken"] == 2
    assert [json.loads(x)["key"]["kind"] for x in ck.read_text().splitlines()] == ["cells", "example"]
    table = lambda t: t.split("PrimePar's worked example", 1)[1].split("Wall time")[0]   # noqa: E731
    assert table(results.read_text()) == table(text)
