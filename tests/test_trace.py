import subprocess
import sys

import pytest
import torch

from stpc import models, trace
from stpc.planner import analyse


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_traced_graph_matches_eager(name):
    torch.manual_seed(0)
    m = models.build(name, tied_head=False)
    idx, tgt = models.example_inputs(name, 2, 16, device="cpu")
    tg = trace(m, (idx, tgt))
    got = tg.gm(*tg.state_args(m), idx, tgt)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, m(idx, tgt), rtol=0, atol=0)
    # Logits too, not just the loss.
    tg2 = trace(m, (idx,))
    out = tg2.gm(*tg2.state_args(m), idx)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, m(idx), rtol=0, atol=0)


def test_parameters_identified_by_fqn():
    m = models.build("llama-tiny")
    tg = trace(m, models.example_inputs("llama-tiny", 1, 8, device="cpu"))
    assert set(tg.param_fqns.values()) == {n for n, _ in m.named_parameters()}
    placeholders = {n.name: n for n in tg.graph.nodes if n.op == "placeholder"}
    for ph, fqn in tg.param_fqns.items():
        assert placeholders[ph].meta["param"] == fqn
        assert tuple(placeholders[ph].meta["val"].shape) == tuple(m.get_parameter(fqn).shape)


def test_every_node_annotated():
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs("gpt-tiny", 2, 16))
    for n in tg.graph.nodes:
        for key in ("flops", "bytes_read", "bytes_written", "param", "module", "source"):
            assert key in n.meta, (n.name, key)
        if n.op == "call_function":
            assert isinstance(n.meta["val"], torch.Tensor) or isinstance(n.meta["val"], (tuple, list))
            assert n.meta["source"].endswith(tuple(f":{i}" for i in range(1, 10000))), n.name
    linears = [n for n in tg.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears[0].meta["module"] == "layers.0.attn.q_proj"
    assert "models.py" in linears[0].meta["source"]


def test_meta_trace_allocates_nothing():
    with torch.device("meta"):
        m = models.build("gpt2-small")
    tg = trace(m, models.example_inputs("gpt2-small", 4, 128))
    assert all(n.meta["val"].device.type == "meta" for n in tg.graph.nodes
               if n.op == "placeholder")


_TRACE_70B = """
import resource, time, torch
from stpc import models, trace
t = time.perf_counter()
with torch.device("meta"):
    m = models.build("llama2-70b")
tg = trace(m, models.example_inputs("llama2-70b", 1, 4096))
dt = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(dt, rss, tg.num_params(), tg.total_flops())
"""


@pytest.mark.slow
def test_llama2_70b_traces_fast_on_meta():
    # A fresh process so the peak RSS is this trace's alone.
    out = subprocess.run([sys.executable, "-c", _TRACE_70B], capture_output=True, text=True, check=True)
    dt, rss, nparams, flops = out.stdout.split()
    assert float(dt) < 30, f"trace took {dt}s"
    assert int(rss) < 3 * 2**30, f"peak RSS {int(rss) / 2**30:.2f} GiB"
    assert abs(int(nparams) / 68.98e9 - 1) < 0.02
    # Forward FLOPs of one 4096-token sequence: ~2 * params * tokens plus attention.
    assert 2 * 68.98e9 * 4096 < float(flops) < 1.2 * 2 * 68.98e9 * 4096


def test_tensor_constant_in_forward_is_a_clear_error():
    class C(torch.nn.Module):
        def forward(self, x):
            return x * torch.tensor([1.0, 2.0])

    with pytest.raises(ValueError, match=r"tensor constant .*register_buffer") as e:
        trace(C(), (torch.ones(3, 2),))
    assert "test_trace.py:" in str(e.value)


def test_trace_analyses_the_graph_once_and_again_when_it_changes():
    m = models.build("gpt-tiny")
    tg = trace(m, models.example_inputs("gpt-tiny", 2, 16, device="cpu"))
    facts = tg.facts
    assert facts is not None and tg.meta["analysis_s"] > 0
    assert facts.tie  # gpt-tiny's layers are tied
    assert analyse(tg) is facts  # every mesh shape and search reuses it
    g = tg.graph
    # the same number of nodes, rewired (a pass lints and recompiles): analysed again
    add = next(n for n in g.nodes if n.target == torch.ops.aten.add.Tensor
               and all(isinstance(a, torch.fx.Node) for a in n.args[:2]))
    add.args = (add.args[1], add.args[0]) + tuple(add.args[2:])
    tg.gm.recompile()
    assert analyse(tg) is not facts
    facts = tg.facts
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        g.call_function(torch.ops.aten.zeros.default, ([1],))
    assert analyse(tg) is not facts and analyse(tg) is tg.facts


def test_tied_parameters_are_recorded():
    with torch.device("meta"):
        gpt, llama = models.build("gpt-tiny"), models.build("llama-tiny")
    tg = trace(gpt, models.example_inputs("gpt-tiny", 2, 16, device="meta"))
    assert tg.tied_params == {"p_lm_head_weight": "p_wte_weight"}  # gpt-tiny ties its head to wte
    assert tg.param_fqns["p_lm_head_weight"] == "lm_head.weight"
    tl = trace(llama, models.example_inputs("llama-tiny", 2, 16, device="meta"))
    assert tl.tied_params == {} and not models.get_config("llama-tiny").tied_head
