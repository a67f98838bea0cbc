"""benchmarks/skew_check.py: the skew read per round as calibrate reads its blocking probe
(synthetic rounds), and a short run on 2 gloo ranks writing its section."""
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import skew_check  # noqa: E402


def _case(compute, collective, both):
    return {"compute": list(compute), "collective": list(collective), "both": list(both)}


def test_skew_is_the_pair_less_the_typical_compute_and_the_collective():
    # three ranks, one slow at its compute all along: the pair waits for it, the typical
    # rank's compute is the median one's; 5 ms of skew each round on top; the pair and the
    # collective end when their slowest member does (the slow rank's collective is slower too)
    ranks = [{"4 GEMMs": _case([c] * 3, [0.008 + d] * 3, [0.070 + 0.008 + d + 0.005] * 3)}
             for c, d in ((0.060, 0.0), (0.062, 0.0), (0.070, 0.002))]
    (row,) = skew_check.skew_rows(ranks)
    assert row["compute_s"] == pytest.approx(0.062) and row["rounds"] == 3
    assert row["skew_s"] == pytest.approx(0.070 + 0.005 - 0.062)   # (the medians over ranks would say 8 ms)
    prof = {"overlap": {"collective_sync_s": 0.004, "ring_sync_s": 0.002, "blocking": {"gemms_typical_s": 0.0155}}}
    rows = [row, {"case": "P(2x2) op, 2 steps", "compute_s": 0.02, "skew_s": 0.003, "min_s": 0.0, "max_s": 0.006,
                  "rounds": 3},
            {"case": "its 2 GEMMs as a block", "compute_s": 0.016, "skew_s": 0.005, "min_s": 0.001, "max_s": 0.009,
             "rounds": 3}]
    text = skew_check.report({"ranks": 3, "rounds": 3, "cluster": "p.json"}, rows, prof, "machine: test", "cmd")
    # the square-root law through the profile's figure: 4 ms x sqrt(62 / 15.5) = 8 ms
    assert "| 4 GEMMs | 62.0 | 13.00 | 13.0 .. 13.0 | 8.0 |" in text, text
    assert "After the P(2x2) op the skew was 3.00 ms, after its GEMMs as a plain block 5.00 ms" in text
    assert "`ring_sync_s`" in text and "2.00 ms" in text
    # the grid LayerNorm's row: its law through the compute the planner charges after the
    # norm's exchange (1 ms: 4 ms x sqrt(1 / 15.5) = 1.0 ms), not its measured whole
    rows.append({"case": skew_check.GRID_NORM_CASE, "compute_s": 0.012, "skew_s": -0.0002, "min_s": -0.004,
                 "max_s": 0.003, "rounds": 3})
    text = skew_check.report({"ranks": 4, "rounds": 3, "cluster": "p.json"}, rows, prof, "machine: test", "cmd",
                             norm_tail_s=0.001)
    assert f"| {skew_check.GRID_NORM_CASE} | 12.0 | -0.20 | -4.0 .. 3.0 | 1.0 |" in text, text
    assert "After the grid LayerNorm" in text and "the skew was -0.20 ms" in text and "1.00 ms" in text


def test_the_planner_charges_the_grid_norm_a_short_compute_after_its_exchange():
    """What the skew section's grid LayerNorm row sets beside its measured skew: the
    planner's forward compute of that norm (the script's block), under a millisecond on the
    development VM's profile; none where the profile gives no figure to scale."""
    profile = str(ROOT / "benchmarks" / "data" / "calibration_cpu_vm_s66.json")
    tail = skew_check.grid_norm_tail_s(profile)
    assert tail is not None and 0 < tail < 1e-3


@pytest.mark.multirank
def test_short_run_writes_its_section(tmp_path):
    js, md = tmp_path / "skew.json", tmp_path / "RESULTS.md"
    md.write_text("# R\n\n<!-- bench:skew -->\nold\n<!-- /bench:skew -->\n")
    profile = str(ROOT / "benchmarks" / "data" / "calibration_cpu_vm_s50.json")
    assert skew_check.main(["--ranks", "4", "--rounds", "2", "--blocks", "1,8", "--cluster", profile,
                            "--json", str(js), "--results", str(md)]) == 0
    res = json.loads(js.read_text())
    cases = [r["case"] for r in res["rows"]]
    assert cases == ["1 GEMM", "8 GEMMs", "P(2x2) op, 2 steps", "its 2 GEMMs as a block", skew_check.GRID_NORM_CASE]
    # eight GEMMs before the collective take longer on the typical rank than one
    times = {r["case"]: r["compute_s"] for r in res["rows"]}
    assert times["8 GEMMs"] > 3 * times["1 GEMM"]
    assert all(r["rounds"] == 2 for r in res["rows"])
    text = md.read_text()
    assert "\nold\n" not in text and "| 8 GEMMs |" in text and "| P(2x2) op, 2 steps |" in text
    assert "After the P(2x2) op the skew was" in text and "`ring_sync_s`" in text
    assert "After the grid LayerNorm" in text
