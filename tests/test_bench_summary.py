"""`python -m stpc bench summary`: RESULTS.md's "Where stpc stands" is each bench section's
headline, copied out of the section, and stays in step with the sections."""
import pathlib

from stpc.cli.bench import main_bench, write_section
from stpc.cli.bench_summary import SECTIONS, headlines, section_text, summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

_RUNTIME = ("## Runtime: stpc against torch's own engines (issue 17)\n\nmachine: x86_64 x86_64, 2 cores, torch 2.13.0+cpu, "
            "python 3.11.7; 2026-11-30 10:35 UTC\n\n| a | b |\n|---|---|\n\nTargets met: {} of 5 rows.\n")


def test_every_bench_section_of_results_md_has_a_headline():
    doc = RESULTS.read_text()
    for name in SECTIONS:
        text = section_text(doc, name)
        assert text is not None, f"RESULTS.md has no {name} section"
        assert headlines(name, text), f"no headline found in RESULTS.md's {name} section"


def test_results_md_summary_is_the_one_its_sections_give():
    doc = RESULTS.read_text()
    assert section_text(doc, "summary").strip() == summary(doc).strip(), (
        "RESULTS.md's summary is stale: run python -m stpc bench summary --results benchmarks/RESULTS.md")


def test_writing_a_section_writes_the_summary_again(tmp_path):
    path = str(tmp_path / "RESULTS.md")
    with open(path, "w") as f:
        f.write("# results\n\n<!-- bench:summary -->\n<!-- /bench:summary -->\n\n## notes\nkeep me\n")
    write_section(path, "runtime", _RUNTIME.format(3))
    doc = open(path).read()
    assert "Targets met: 3 of 5 rows." in section_text(doc, "summary")
    assert "2026-11-30 10:35 UTC, x86_64 x86_64, 2 cores" in section_text(doc, "summary")
    write_section(path, "runtime", _RUNTIME.format(5))
    doc = open(path).read()
    got = section_text(doc, "summary")
    assert "Targets met: 5 of 5 rows." in got and "3 of 5" not in got
    assert doc.index("bench:summary") < doc.index("keep me") < doc.index("bench:runtime")


def test_a_file_without_a_summary_gets_none(tmp_path):
    path = str(tmp_path / "RESULTS.md")
    write_section(path, "runtime", _RUNTIME.format(4))
    assert "bench:summary" not in open(path).read()


def test_a_section_whose_headline_moved_says_so():
    doc = "<!-- bench:planner -->\n## Planner\n\nmachine: m; 2026-01-01 00:00 UTC\n\nno verdict here\n<!-- /bench:planner -->\n"
    assert "no headline found in this section" in summary(doc)


def test_primepar_headline_keeps_the_counts_not_the_cell_lists():
    text = ("### primepar-v100 (fp16), budget 25.6 GiB per device\n\n"
            "Geo-mean speedup at 32 devices against the best fitting baseline (modelled): 1.002x over 6 cells.\n\n"
            "stpc wins (> 1.02x) in 1: opt-6.7b on 4 (1.03x); stpc ties (0.98-1.02x) in 2: a on 8 (1.00x), b on 8 "
            "(1.01x); stpc loses (< 0.98x) in 0.\n")
    (line,) = headlines("primepar", text)
    assert line == ("primepar-v100 (fp16), budget 25.6 GiB per device: Geo-mean speedup at 32 devices against the best "
                    "fitting baseline (modelled): 1.002x over 6 cells. stpc wins (> 1.02x) in 1; stpc ties (0.98-1.02x) "
                    "in 2; stpc loses (< 0.98x) in 0 cells.")


def test_the_verb_writes_the_summary_and_refuses_a_missing_file(tmp_path, capsys):
    path = tmp_path / "RESULTS.md"
    path.write_text("<!-- bench:runtime -->\n" + _RUNTIME.format(2) + "<!-- /bench:runtime -->\n")
    assert main_bench(["summary", "--results", str(path)]) == 0
    assert "Targets met: 2 of 5 rows." in section_text(path.read_text(), "summary")
    assert main_bench(["summary", "--results", str(tmp_path / "none.md")]) == 2
    assert "no file" in capsys.readouterr().err
