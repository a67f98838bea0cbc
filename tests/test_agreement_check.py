"""benchmarks/agreement_check.py: rounds read as the slowest rank's (synthetic ranks), and a
short run on 2 gloo ranks writing its section."""
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import agreement_check  # noqa: E402


def test_a_round_is_its_slowest_rank_and_the_cpu_the_ranks_mean():
    check, old = list(agreement_check.cases(2))[:2]
    # three rounds; rank 1 the slow one in the first two, rank 0 in the third
    ranks = [{check: [(0.001, 0.0002), (0.001, 0.0002), (0.005, 0.0004)], old: [(0.004, 0.001)] * 3},
             {check: [(0.003, 0.0004), (0.002, 0.0004), (0.001, 0.0002)], old: [(0.006, 0.002)] * 3}]
    by = {r["case"]: r for r in agreement_check.rows(ranks)}
    assert by[check]["wall_s"] == pytest.approx(0.003)     # of the slowest ranks' 0.003, 0.002, 0.005
    assert by[check]["cpu_s"] == pytest.approx(0.0003)     # of the means 0.0003, 0.0003, 0.0003
    assert by[old]["wall_s"] == pytest.approx(0.006) and by[check]["rounds"] == 3
    text = agreement_check.report({"ranks": 2, "rounds": 3}, list(by.values()), "machine: test", "cmd")
    assert "took 3.00 ms, the all-gather it replaced 6.00 ms" in text, text


def test_the_cases_sweep_the_element_counts_around_the_ranks():
    names = list(agreement_check.cases(4))
    assert names[0].startswith("signature check") and names[1].startswith("the check it replaced")
    assert names[2:] == [f"all-reduce of {n} float element{'' if n == 1 else 's'}" for n in (*range(1, 9), 65536)]


@pytest.mark.multirank
def test_short_run_writes_its_section(tmp_path):
    js, md = tmp_path / "agree.json", tmp_path / "RESULTS.md"
    md.write_text("# R\n\n<!-- bench:agreement -->\nold\n<!-- /bench:agreement -->\n")
    assert agreement_check.main(["--ranks", "2", "--rounds", "2", "--json", str(js), "--results", str(md)]) == 0
    res = json.loads(js.read_text())
    assert [r["case"] for r in res["rows"]] == list(agreement_check.cases(2))
    assert all(r["rounds"] == 2 and r["wall_s"] > 0 for r in res["rows"])
    text = md.read_text()
    assert "old" not in text and "| signature check (all-reduce of two integers) |" in text
