"""stpc.frontend.graph_diff: snapshots of a graph and what changed between two of them.

Hand-made fx graphs pin each kind of change (added, removed, changed, moved) and the
renderings; the passes pipeline on the tiny GPT under forced AG/RS rings pins what the
notebook graph_dumps.ipynb shows: collectives from insert_collectives, ring ops from
ring_decompose, nothing from verify.
"""
import os
import sys

import torch
import torch.fx as fx

from stpc.compile import run_passes
from stpc.frontend.graph_diff import GraphDiff, PassLog, _kept_in_order, _split_args, diff, snapshot

sys.path.insert(0, os.path.dirname(__file__))
from _graphs import traced_and_plan  # noqa: E402


def _graph():
    def f(x, y):
        a = x + 1
        b = a * y
        c = b.relu()
        return c - a

    return fx.symbolic_trace(f)


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_an_unchanged_graph_diffs_empty():
    gm = _graph()
    d = diff(snapshot(gm), snapshot(gm), "nothing")
    assert d.empty and d.counts() == {"nodes": 7, "added": 0, "removed": 0, "changed": 0, "moved": 0}
    assert "no change" in d.to_text() and "no change" in d.to_html()
    assert [s for s, _ in d.rows(context=None)] == ["same"] * 7
    assert d.rows(context=1) == [("folded", 7)]


def test_added_removed_changed_and_moved_nodes_are_each_found():
    gm = _graph()
    before = snapshot(gm)
    g = gm.graph
    mul, relu, sub = _node(gm, "mul"), _node(gm, "relu"), _node(gm, "sub")
    # added: a neg between mul and relu; changed: relu now reads it
    with g.inserting_after(mul):
        neg = g.call_function(torch.neg, (mul,))
    relu.replace_input_with(mul, neg)
    # removed: sub, replaced by a new add of the same inputs (a new name: fx never reuses one)
    with g.inserting_before(sub):
        new = g.call_function(torch.add, sub.args)
    sub.replace_all_uses_with(new)
    g.erase_node(sub)
    # moved: x's placeholder after y's
    _node(gm, "y").append(_node(gm, "x"))
    g.lint()
    d = diff(before, snapshot(gm), "edit")
    assert d.added == ["neg", "add_1"]
    assert d.removed == ["sub"]
    assert set(d.changed) == {"relu", "output"}
    assert d.changed["relu"]["args"] == ("mul", "neg")
    assert d.moved == ["x"] or d.moved == ["y"]
    assert d.ops_added() == {"neg": 1, "add": 1} and d.ops_removed() == {"sub": 1}
    assert d.columns_changed() == {"args": 2}
    statuses = [(s, r.name) for s, r in d.rows(context=None)]
    # the removed node sits where it was: after the last node before it that both graphs keep
    # (relu), so before what replaced it, as in a unified diff
    assert statuses[-4:] == [("changed", "relu"), ("removed", "sub"), ("added", "add_1"), ("changed", "output")]
    text = d.to_text(context=None)
    assert "+ neg:" in text and "- sub:" in text and "~ relu:" in text and "mul -> neg" in text
    html = d.to_html(context=None)
    for colour in ("#e6ffec", "#ffebe9", "#fff8c5", "#ddf4ff"):  # added, removed, changed, moved
        assert colour in html
    assert "<s style='color:#999'>mul</s>" in html and "<b>neg</b>" in html
    assert d._repr_html_() == d.to_html() and repr(d).startswith("<GraphDiff edit:")


def test_unchanged_runs_fold_around_the_changes():
    gm = _graph()
    before = snapshot(gm)
    out = _node(gm, "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(torch.neg, (_node(gm, "sub"),))
    d = diff(before, snapshot(gm))
    rows = d.rows(context=1)
    assert rows[0] == ("folded", 5) and [s for s, _ in rows[1:]] == ["same", "added", "same"]
    assert "... 5 unchanged nodes" in d.to_text()
    assert d.rows(context=0) == [("folded", 6), ("added", d.after[6]), ("folded", 1)]


def test_snapshot_rows_say_op_args_shape_placement_and_communication():
    tg, plan = traced_and_plan("gpt-tiny", "2x2", family="ag_rs")
    rows = {r.name: r for r in snapshot(tg, {n: p.out for n, p in plan.nodes.items()})}
    lin = next(n for n, p in plan.nodes.items() if p.module == "layers.0.attn.q_proj" and p.op == "linear.default")
    assert rows[lin].op == "linear" and rows[lin].shape == "4x16x32"
    assert rows[lin].placement == "(" + ",".join(plan.nodes[lin].out) + ")"
    assert rows["p_wpe_weight"].op == "placeholder" and rows["p_wpe_weight"].args == ""
    assert snapshot(tg)[0].placement == ""  # no plan given, none on the traced graph


def test_the_pass_log_shows_what_each_pass_did():
    tg, plan = traced_and_plan("gpt-tiny", "2x2", family="ag_rs")
    log = PassLog({n: p.out for n, p in plan.nodes.items()})
    run_passes(tg.gm, plan, on_pass=log)
    assert log.names[:4] == ["traced", "shard_params", "insert_collectives", "ring_decompose"]
    assert log.names[-1] == "verify"
    shard = log.diff("shard_params")
    assert not shard.added and not shard.removed and shard.columns_changed()["shape"] > 0
    ins = log.diff("insert_collectives").ops_added()
    assert ins["all_gather"] > 0 and ins["reduce_scatter"] > 0
    counts = plan.strategy_counts()
    ring = log.diff("ring_decompose")
    assert ring.ops_added()["ring_allgather_matmul"] == counts["ag_ring"]
    assert ring.ops_added()["ring_matmul_reducescatter"] == counts["rs_ring"]
    assert ring.ops_removed()["linear"] == counts["ag_ring"] + counts["rs_ring"]
    assert log.diff("verify").empty
    over = log.overview()
    assert [r["pass"] for r in over] == log.names[1:]
    assert over[1]["added"] == len(log.diff("insert_collectives").added)
    assert "insert_collectives" in log._repr_html_() and "insert_collectives" in repr(log)
    assert all(isinstance(d, GraphDiff) for d in log.diffs())


def test_helpers():
    assert _kept_in_order([0, 1, 2, 3]) == {0, 1, 2, 3}
    assert _kept_in_order([1, 2, 3, 0]) == {0, 1, 2}  # the last one moved (to the front)
    assert len(_kept_in_order([3, 0, 1, 2])) == 3 and _kept_in_order([]) == set()
    assert _split_args("a, [1, 2], b=(c, d), e='x, y'") == ["a", "[1, 2]", "b=(c, d)", "e='x, y'"]
    assert _split_args("") == []
