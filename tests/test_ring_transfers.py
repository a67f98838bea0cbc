"""The cost model's ring transfers are the ones the runtime's ring ops post.

The planner costs an AG ring, an RS ring and a P(2x2) linear step by step
(``planner.costs.NodeTimer``, ``CostModel.ring``); the ops (``runtime.ops.ring``) post
their P2P transfers in batches. One spawn of 4 gloo ranks runs each op forward and
backward on the local blocks a planned linear has and records the bytes each batch sends;
the items below cost the same linear's strategy with a model whose P2P "seconds" are its
bytes and compare: the bytes each phase moves, and for the AG and RS rings the transfer of
every step (a ring of n blocks moves n - 1 of them; the AG ring's backward moves two blocks
to one peer in each step between its first and its last).
"""
import functools
import os
import sys

import pytest
import torch

from stpc import trace
from stpc.cost_models import CostModel, get_cluster
from stpc.planner.costs import NodeTimer
from stpc.planner.strategies import enumerate_strategies
from stpc.runtime.launch import spawn

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.multirank

B, S, IN, OUT = 2, 8, 16, 8   # x [B, S, IN] @ W.t(), W [OUT, IN]; every dim divisible by 4
P = 4


def _record(ops_of_phase) -> list[list[int]]:
    """Per phase, the bytes each ``batch_isend_irecv`` call sends (its isends together)."""
    import torch.distributed as dist

    real = dist.batch_isend_irecv
    posts: list[int] = []

    def counting(ops):
        posts.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        phases = []
        for run in ops_of_phase:
            posts.clear()
            run()
            phases.append(list(posts))
        return phases
    finally:
        dist.batch_isend_irecv = real


def _worker(rank: int, world: int) -> dict:
    import stpc.runtime.ops  # noqa: F401  (registers the ops)
    from stpc.runtime.ops.ring import group_name_of

    g = group_name_of(None)
    torch.manual_seed(rank)
    out = {}

    def fwd_bwd(op):
        held = {}

        def forward():
            held["y"] = op()

        def backward():
            held["y"].backward(torch.ones_like(held["y"]))
        return [forward, backward]

    # AG ring: x's rows (the sequence dim) split, W split on its output features
    x = torch.randn(B, S // P, IN, requires_grad=True)
    w = torch.randn(OUT // P, IN, requires_grad=True)
    out["ag_ring"] = _record(fwd_bwd(lambda: torch.ops.stpc.ring_allgather_matmul(x, w.t(), 1, g)))
    # RS ring: the contraction split; the output's rows scattered
    x = torch.randn(B, S, IN // P, requires_grad=True)
    w = torch.randn(OUT, IN // P, requires_grad=True)
    out["rs_ring"] = _record(fwd_bwd(lambda: torch.ops.stpc.ring_matmul_reducescatter(x, w.t(), 1, g)))
    # P(2x2): a block of x's rows and of its features, a block of W
    x = torch.randn(B * S // 2, IN // 2, requires_grad=True)
    w = torch.randn(IN // 2, OUT // 2, requires_grad=True)
    out["p2x2"] = _record(fwd_bwd(lambda: torch.ops.stpc.primepar_linear(x, w, g, 1)[0]))
    return out


@functools.lru_cache(maxsize=None)
def _posted() -> dict:
    """Rank 0's record (every rank posts alike)."""
    return spawn(_worker, P, timeout_s=120)[0]


class _Bytes(CostModel):
    """A model whose P2P costs its bytes and whose ring steps record their transfers."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps: list[float] = []

    def p2p(self, nbytes, axis):
        return float(nbytes)

    def ring_step(self, compute_s, transfer_s, slowdown=None):
        self.steps.append(transfer_s)
        return 0.0


def _modelled(kind: str) -> tuple[list[float], list[float]]:
    """The transfers of every step the model charges, forward and backward, for the linear
    of the worker's shapes under ``kind`` on a mesh of 4 (dgx-h100: one switch, so blocks
    posted to two peers at once share the device's port)."""
    lin = torch.nn.Linear(IN, OUT, bias=False, device="meta")
    tg = trace(lin, (torch.empty(B, S, IN, device="meta", requires_grad=True),))
    node = next(n for n in tg.graph.nodes if n.target is torch.ops.aten.linear.default)
    want = {"ag_ring": ("S1", "S0"), "rs_ring": ("S2", "S1"), "p2x2": None}[kind]
    s = next(s for s in enumerate_strategies(node, (P,))[0] if s.kind == kind
             and (want is None or (s.ins[0][0], s.ins[1][0]) == want))
    cm = _Bytes(get_cluster("dgx-h100"), (P,))
    timer = NodeTimer(node, cm, [True, True])
    timer.forward(s)
    forward = list(cm.steps)
    cm.steps.clear()
    timer(s)
    return forward, cm.steps[len(forward):]


@pytest.mark.parametrize("kind", ["ag_ring", "rs_ring"])
def test_a_rings_modelled_steps_move_what_its_op_posts(kind):
    forward, backward = _modelled(kind)
    posted_fwd, posted_bwd = _posted()[kind]
    assert len(forward) == P and len(backward) == P          # one ring step per block
    assert sorted(t for t in forward if t) == sorted(posted_fwd)
    assert sorted(t for t in backward if t) == sorted(posted_bwd)
    assert sum(1 for t in forward if t) == P - 1             # n blocks, n - 1 of them moved


def test_the_ag_rings_backward_moves_two_blocks_a_step_between_its_first_and_last():
    _, backward = _modelled("ag_ring")
    block = B * S // P * IN * 4
    assert backward == [block] + [2 * block] * (P - 2) + [block]
    assert _posted()["ag_ring"][1] == backward


def test_a_p2x2_linear_moves_in_each_step_the_blocks_its_op_posts():
    """q = 2 steps a phase, the first moving two blocks to two neighbours, the last nothing;
    the gradient phase's first step also carries the dI shift (posted as the phase begins,
    one x block) and its last the dW accumulator (a weight block, beside the last GEMM)."""
    forward, backward = _modelled("p2x2")
    x, w, out = B * S // 2 * IN // 2 * 4, IN // 2 * OUT // 2 * 4, B * S // 2 * OUT // 2 * 4
    assert forward == [x + w, 0.0]
    assert backward == [out + w, 0.0, x + out + x, w]
    posted_fwd, posted_bwd = _posted()["p2x2"]
    assert posted_fwd == [x + w]
    # the op's posts: the backward phase's step, the dI shift, the gradient phase's step, the accumulator
    assert posted_bwd == [out + w, x, x + out, w]


def test_calibrates_grid_probe_moves_the_blocks_the_model_charges_a_p2x2_linear():
    """``calibrate``'s P(2x2) probe times the op's transfers alone step by step
    (``grid_transfer_steps``) and reads its slowdown against them: the steps must be the
    ones the planner charges, block for block."""
    from stpc.cli.calibrate import grid_transfer_steps

    forward, backward = _modelled("p2x2")
    size = {"x": B * S // 2 * IN // 2 * 4, "w": IN // 2 * OUT // 2 * 4, "o": B * S // 2 * OUT // 2 * 4}
    probed = [sum(size[b] for b in step) for step in grid_transfer_steps(2)]
    assert probed == [t for t in forward + backward if t]
    # q - 1 moving steps in forward and backward, all q of the gradient phase (its last: dW's accumulator)
    assert len(grid_transfer_steps(4)) == 3 * 4 - 2


def test_a_p2x2_linear_pays_the_grids_own_slowdown_and_a_ring_the_rings():
    """``Cluster.grid_overlap_slowdown`` prices a P(2x2) op's transfers, and only its: an AG
    ring keeps ``ring_overlap_slowdown``; unset, the grid takes the ring's figure."""
    import dataclasses

    lin = torch.nn.Linear(IN, OUT, bias=False, device="meta")
    tg = trace(lin, (torch.empty(B, S, IN, device="meta", requires_grad=True),))
    node = next(n for n in tg.graph.nodes if n.target is torch.ops.aten.linear.default)
    strategies = enumerate_strategies(node, (P,))[0]
    p2x2 = next(s for s in strategies if s.kind == "p2x2")
    ag = next(s for s in strategies if s.kind == "ag_ring")
    base = dataclasses.replace(get_cluster("dgx-h100"), ring_overlap_slowdown=2.0)

    def cost(cluster, s):
        return NodeTimer(node, CostModel(cluster, (P,)), [True, True])(s)

    assert CostModel(base, (P,)).grid_overlap_slowdown == 2.0
    at = {x: dataclasses.replace(base, grid_overlap_slowdown=x) for x in (0.5, 1.0, 2.0)}
    assert cost(at[0.5], ag) == cost(base, ag)
    assert cost(at[2.0], p2x2) == pytest.approx(cost(base, p2x2))
    # linear in the figure: each moving step adds it times the shorter of its GEMM and transfer
    assert cost(at[1.0], p2x2) > cost(at[0.5], p2x2)
    assert cost(at[2.0], p2x2) - cost(at[0.5], p2x2) == pytest.approx(3 * (cost(at[1.0], p2x2) - cost(at[0.5], p2x2)))
