"""The command line's surface, the same on every verb (issue 15, item 4): ``--help`` exits 0,
a bad flag or flag value and an unknown model or verb exit 2, a failure exits 1; an error is
one line on stderr, ``error: <cause>. Fix: <what to do>``, with no traceback unless
``--debug`` / ``STPC_DEBUG=1``; ``--quiet`` prints the result only and no progress; and the
search's progress callback reports the incumbent, the bound and the elapsed time.

In-process through ``stpc.cli.main`` (fast); two runs through ``python -m stpc`` for the
real exit status. Nothing here spawns ranks."""
import json
import subprocess
import sys
import time

import pytest

from stpc import models, trace
from stpc.cli import COMMANDS, _progress, main
from stpc.cli._common import FLAGS, error_line, meta_trace
from stpc.planner import InfeasibleBudget, SearchProgress, search
from stpc.runtime.launch import SpawnError, SpawnTimeout

VERBS = [["trace"], ["plan"], ["calibrate"], ["demo"], ["bench"], ["bench", "runtime"], ["bench", "fidelity"]]
TAKE_A_MODEL = [["trace"], ["plan", "--mesh", "2"], ["demo"], ["bench", "runtime"], ["bench", "fidelity"]]


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Fix: " in lines[0] and "Traceback" not in err, err
    return lines[0]


def test_the_verbs_are_the_five():
    assert list(COMMANDS) == ["trace", "plan", "calibrate", "demo", "bench"]


@pytest.mark.parametrize("verb", VERBS, ids=" ".join)
def test_help_exits_0(verb, capsys):
    code, out, err = _run(capsys, *verb, "--help")
    assert code == 0 and err == ""
    assert "usage: python -m stpc" in out
    if verb != ["bench"]:  # (bench's own help lists its benchmarks)
        assert "--quiet" in out and "--debug" in out and "shared flags" in out


def test_top_level_help_and_usage(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and all(v in out for v in COMMANDS) and "exit codes: 0 ok, 1 failure, 2 usage" in out
    for argv in ([], ["no-such-verb"], ["--quiet"], ["bench"], ["bench", "no-such-bench"]):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == "", argv
        assert "trace, plan" in _one_error_line(err) or "runtime, fidelity" in err


REQUIRED = {"trace": ["--model", "gpt-tiny"], "plan": ["--model", "gpt-tiny", "--mesh", "2"]}


@pytest.mark.parametrize("verb", VERBS[:4] + VERBS[5:], ids=" ".join)
def test_a_bad_flag_exits_2(verb, capsys):
    code, out, err = _run(capsys, *verb, *REQUIRED.get(verb[0], []), "--no-such-flag")
    assert code == 2 and out == ""
    assert "unrecognized arguments: --no-such-flag" in _one_error_line(err)
    assert f"python -m stpc {' '.join(verb)} --help" in err


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "gpt-tiny", "--mesh", "4xa"],
    ["plan", "--model", "gpt-tiny", "--mesh", "0"],
    ["plan", "--model", "gpt-tiny", "--mesh", "2", "--cluster", "no-such-cluster"],
    ["plan", "--model", "gpt-tiny", "--mesh", "2", "--batch", "0"],
    ["plan", "--model", "gpt-tiny", "--mesh", "2", "--budget-gib", "-1"],
    ["plan", "--model", "gpt-tiny", "--mesh", "2", "--dtype", "fp8"],
    ["plan", "--model", "gpt-tiny", "--mesh", "2", "--hints", "no-such-preset"],
    ["plan", "--model", "gpt-tiny", "--mesh", "2", "--budget-gib", "1", "--no-budget"],
    ["plan", "--model", "gpt-tiny"],
    ["plan", "--model", "gpt-tiny", "--mesh", "8", "--cluster", "cpu-local"],  # 4 devices
    ["trace", "--model", "gpt-tiny", "--layers", "0"],
    ["calibrate", "--ranks", "1"],
    ["calibrate", "--sizes", "lots"],
    ["demo", "--ranks", "3", "--mesh", "2x2"],
    ["demo", "--seq", "100000"],
    ["demo", "--compare", "no-such-model"],
    ["bench", "fidelity", "--ranks", "2"],  # the default plans include p2x2, which needs 4
    ["bench", "fidelity", "--model", "llama-tiny"],  # its config is overridden with a GPT's fields
], ids=lambda a: " ".join(a))
def test_a_bad_flag_value_exits_2(argv, capsys):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    _one_error_line(err)


@pytest.mark.parametrize("verb", TAKE_A_MODEL, ids=lambda a: a[0] if a[0] != "bench" else " ".join(a))
def test_an_unknown_model_exits_2_and_lists_the_known(verb, capsys):
    code, out, err = _run(capsys, *verb, "--model", "no-such-model")
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert "unknown model 'no-such-model'" in line and all(name in line for name in models.CONFIGS)


def test_the_old_calibrate_out_flag_still_parses(capsys):
    code, _, err = _run(capsys, "calibrate", "--out", "p.json", "--ranks", "1")  # stops at --ranks, not --out
    assert code == 2 and "unrecognized" not in err and "at least 2 ranks" in err


# ---------------------------------------------------------------- failures: exit 1, one line, the fix

FACTORY = '''
def broken(batch=8, seq=16):
    raise RuntimeError("the factory broke\\nwith a second line")
'''


def test_a_failure_exits_1_with_one_line_and_its_fix(capsys, tmp_path, monkeypatch):
    code, out, err = _run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "2", "--cluster", "cpu-local",
                          "--budget-gib", "0.000001")
    assert code == 1 and out == ""
    line = _one_error_line(err)
    assert "smallest feasible budget" in line and "Fix: --budget-gib" in line
    # an error stpc has no fix for: its type and first line, and how to see the traceback
    (tmp_path / "broken_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("STPC_DEBUG", raising=False)
    code, out, err = _run(capsys, "trace", "--model", "broken_models:broken")
    assert code == 1
    assert _one_error_line(err) == "error: RuntimeError: the factory broke. Fix: rerun with --debug (or " \
                                   "STPC_DEBUG=1) for the traceback"
    # --debug, or STPC_DEBUG=1: the traceback first, the same line last
    for argv, env in ((["--debug"], None), ([], "1")):
        if env:
            monkeypatch.setenv("STPC_DEBUG", env)
        code, _, err = _run(capsys, "trace", "--model", "broken_models:broken", *argv)
        assert code == 1 and err.startswith("Traceback") and "in broken" in err
        assert err.strip().splitlines()[-1].startswith("error: RuntimeError: the factory broke. Fix:")


def test_error_lines_keep_stpcs_own_fix():
    e = ValueError("stpc.compile: mesh 'x' is not a mesh spec.\nFix: pass a shape")
    assert error_line(e) == "ValueError: stpc.compile: mesh 'x' is not a mesh spec. Fix: pass a shape"
    line = error_line(InfeasibleBudget(2**30, 3 * 2**30 + 12345))
    assert "smallest feasible budget is 3 GiB" in line and "Fix: --budget-gib 3.01 or more" in line
    line = error_line(InfeasibleBudget(2**30, 3 * 2**30 + 12345, 2 * 2**30))  # a least peak not proven
    assert "smallest feasible budget is between 2 and 3 GiB" in line and "Fix: --budget-gib 3.01 or more" in line
    assert error_line(KeyError("unknown thing 'x'")).startswith("KeyError: unknown thing 'x'. Fix: rerun")
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: boom\n"
    assert error_line(SpawnError(2, tb)) == ("rank 2 failed: ValueError: boom. Fix: rerun with --debug (or "
                                             "STPC_DEBUG=1) for the traceback of every rank")
    # the root rank's own last line, not the note on the ranks that failed after it
    note = "\n(ranks [0, 1, 3] failed after it, probably as a consequence)"
    e = SpawnError(2, tb + note, {2: tb, 0: "RuntimeError: connection closed", 1: "x", 3: "y"})
    assert error_line(e) == ("rank 2 failed: ValueError: boom (ranks [0, 1, 3] failed after it). Fix: rerun with "
                             "--debug (or STPC_DEBUG=1) for the traceback of every rank")
    assert "Fix: raise --timeout" in error_line(SpawnTimeout("spawn: ranks [1] of 2 did not finish within 5 s"))
    assert error_line(OSError(2, "No such file or directory")).endswith("Fix: check that the path exists and can "
                                                                       "be written")


def test_python_m_stpc_exit_codes():
    """The real process status: 2 for an unknown model, 0 with --quiet's single line (and no
    progress: stderr is a pipe here)."""
    r = subprocess.run([sys.executable, "-m", "stpc", "plan", "--model", "llama-7b", "--mesh", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert "unknown model 'llama-7b'" in _one_error_line(r.stderr)
    r = subprocess.run([sys.executable, "-m", "stpc", "trace", "--model", "gpt-tiny", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == ""
    assert len(r.stdout.splitlines()) == 1 and r.stdout.startswith("nodes ")


# ---------------------------------------------------------------- --quiet and progress


def _terminal(monkeypatch):
    """stderr (capsys's, so in the test's body) says it is a terminal; progress lines
    appear from the first instant."""
    monkeypatch.setattr(_progress, "DELAY_S", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert _progress.shown(True)


def test_quiet_prints_the_result_only_and_no_progress(capsys, tmp_path, monkeypatch):
    from stpc.cli import _common

    _terminal(monkeypatch)

    def slow_trace(*args, **kwargs):  # a trace long enough for its status line to be drawn
        time.sleep(0.5)
        return trace(*args, **kwargs)

    monkeypatch.setattr(_common, "trace", slow_trace)
    js = tmp_path / "out" / "p.json"
    argv = ["plan", "--model", "gpt-tiny", "--mesh", "4", "--cluster", "cpu-local", "--json", str(js)]
    code, out, err = _run(capsys, *argv, "--quiet")
    assert code == 0 and err == ""
    assert len(out.splitlines()) == 1 and out.startswith("mesh ") and "modelled step" in out
    assert json.loads(js.read_text())["modelled_step_time_s"] > 0  # its folder made
    code, out, err = _run(capsys, "trace", "--model", "gpt-tiny", "-q")
    assert code == 0 and err == "" and len(out.splitlines()) == 1
    # without --quiet, on a terminal: the status lines (the trace, the search) on stderr, never stdout
    code, out, err = _run(capsys, *argv)
    assert code == 0 and "trace gpt-tiny" in err and "trace gpt-tiny" not in out
    assert "wrote" in out and "modelled step" in out


def test_progress_is_off_when_stderr_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "DELAY_S", 0.0)
    with _progress.Status("work", True) as status:
        status.set("busy")
        b = _progress.bar(3, "steps", True)
        b.update(3)
        b.close()
    assert capsys.readouterr().err == ""
    assert not _progress.shown(True) and b.disable


def test_the_search_line_says_incumbent_bound_gap_elapsed():
    line = _progress.describe(SearchProgress("cpsat", "mesh 2x2", 1, 3, 2.5e-3, 2.0e-3, 4.2))
    assert line == "CP-SAT on mesh 2x2 (2/3)  incumbent 2.5 ms  bound 2 ms (gap 20.0%)"
    assert _progress.describe(SearchProgress("build", "mesh 4", 0, 2, None, None, 0.1)) == "building mesh 4 (1/2)"


# ---------------------------------------------------------------- the search's progress callback


def test_search_reports_incumbent_bound_and_elapsed():
    tg, _, _ = meta_trace("gpt-tiny")
    events: list[SearchProgress] = []
    plan = search(tg, 4, "cpu-local", progress=events.append)
    assert [e.phase for e in events][0] == "build" and events[-1].phase == "done"
    assert {e.phase for e in events} == {"build", "solve", "done"}  # no budget binds: elimination only
    # mesh 4 with weights regathered or kept; 2x2 regathered, or kept over axis 0, axis 1 or both
    assert all(e.total == 6 for e in events)
    assert [e.elapsed_s for e in events] == sorted(e.elapsed_s for e in events)
    best = plan.modelled_step_time_s
    assert events[-1].incumbent_s == events[-1].bound_s == best
    for e in events:
        assert e.bound_s is None or e.bound_s <= best + 1e-12
        assert e.incumbent_s is None or e.incumbent_s >= best - 1e-12
    solving = [e for e in events if e.phase == "solve"]
    assert solving[0].incumbent_s is None and solving[0].bound_s is not None  # elimination's bound, before any plan
    assert solving[-1].incumbent_s is not None


def test_search_reports_cpsat_progress_where_the_budget_binds():
    """One layer on 2 devices under a budget halfway between the smallest feasible peak and
    the unbudgeted plan's (without recomputation, which would fit it at its memory-blind
    optimum): CP-SAT solves it (a fraction of a second), reporting better solutions and
    bounds; the plan is the one found without a callback."""
    tg, _, _ = meta_trace("gpt-tiny", 8, 64, layers=1)
    free = search(tg, 2, "cpu-local")
    budget = (_least_peak(tg) + free.peak_memory_bytes) / 2
    events: list[SearchProgress] = []
    plan = search(tg, 2, "cpu-local", budget_bytes=budget, progress=events.append, recompute="none")
    assert plan.hash() == search(tg, 2, "cpu-local", budget_bytes=budget, recompute="none").hash()
    cp = [e for e in events if e.phase == "cpsat"]
    assert cp and any(e.incumbent_s is not None for e in cp)
    best = plan.modelled_step_time_s
    incumbents = [e.incumbent_s for e in cp if e.incumbent_s is not None]
    bounds = [e.bound_s for e in cp]
    assert incumbents == sorted(incumbents, reverse=True) and incumbents[-1] >= best - 1e-12
    assert bounds == sorted(bounds) and bounds[-1] <= best + 1e-12
    assert events[-1].phase == "done" and events[-1].incumbent_s == best


def _least_peak(tg) -> int:
    with pytest.raises(InfeasibleBudget) as err:
        search(tg, 2, "cpu-local", budget_bytes=1, recompute="none")
    return err.value.min_budget


def test_a_progress_callback_can_stop_the_search():
    tg, _, _ = meta_trace("gpt-tiny", 8, 64, layers=1)

    class Enough(Exception):
        pass

    def stop(ev):
        if ev.phase == "cpsat":
            raise Enough

    free = search(tg, 2, "cpu-local")
    with pytest.raises(Enough):
        search(tg, 2, "cpu-local", budget_bytes=(_least_peak(tg) + free.peak_memory_bytes) / 2, progress=stop,
               recompute="none")


def test_shared_flags_are_defined_once():
    assert {"model", "layers", "batch", "seq", "mesh", "cluster", "dtype", "budget-gib", "json"} <= set(FLAGS)
