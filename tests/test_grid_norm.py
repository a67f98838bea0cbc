"""``runtime.grid_layer_norm`` and ``grid_rms_norm``: a LayerNorm and an RMSNorm over a P(2x2)
block layout on 4 real gloo ranks, against ``torch.nn.functional.layer_norm`` and aten's
``rms_norm`` of the whole tensor on one device.

Each rank holds its B(1, 2) block of a [2, 8, 12] input (rows over the grid's rows, the
normalised dim over its columns); its output must be its block of the single-device result,
its input gradient its block of the single-device gradient, and the weight and bias
gradients, summed over the four ranks (the reduction a Replicate parameter read by a split
op gets), the single-device ones. fp64, so the comparison is tight; and the only
communication is the statistics' all-gathers (2 values per local row; the RMSNorm's 1),
never the activation. ``grid_column`` (a whole 1-D operand's grid-column slice: RMSNorm's
weight beside the block) and ``grid_bias_add`` likewise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stpc.runtime.launch import spawn
from stpc.runtime.reshard import shard_tensor

FULL = (2, 8, 12)
TOK = ("B1.2",)


def _worker(rank, world, affine):
    import torch.distributed as dist

    import stpc.runtime.reshard as reshard
    from stpc.runtime import grid_layer_norm

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(FULL, generator=gen, dtype=torch.float64) * 3 + 1
    dy = torch.randn(FULL, generator=gen, dtype=torch.float64)
    w = torch.randn(FULL[-1], generator=gen, dtype=torch.float64) if affine else None
    b = torch.randn(FULL[-1], generator=gen, dtype=torch.float64) if affine else None

    ref_x = x.clone().requires_grad_()
    ref_w = w.clone().requires_grad_() if affine else None
    ref_b = b.clone().requires_grad_() if affine else None
    ref = F.layer_norm(ref_x, FULL[-1:], ref_w, ref_b, 1e-5)
    ref.backward(dy)

    gathered = []
    real_ag = reshard._ag

    def recording_ag(t, dim, group):
        gathered.append(tuple(t.shape))
        return real_ag(t, dim, group)

    import stpc.runtime.grid_norm as grid_norm
    grid_norm._ag = recording_ag
    try:
        lx = shard_tensor(x, TOK, (world,), (rank,)).clone().requires_grad_()
        lw = w.clone().requires_grad_() if affine else None
        lb = b.clone().requires_grad_() if affine else None
        out = grid_layer_norm(lx, lw, lb, 1e-5, name)
        out.backward(shard_tensor(dy, TOK, (world,), (rank,)))
    finally:
        grid_norm._ag = real_ag
    res = {"out": (out.detach() - shard_tensor(ref.detach(), TOK, (world,), (rank,))).abs().max().item(),
           "dx": (lx.grad - shard_tensor(ref_x.grad, TOK, (world,), (rank,))).abs().max().item(),
           "gathered": gathered}
    if affine:
        for key, local, whole in (("dw", lw.grad, ref_w.grad), ("db", lb.grad, ref_b.grad)):
            total = local.clone()
            dist.all_reduce(total)
            res[key] = (total - whole).abs().max().item()
    return res


@pytest.fixture(scope="module", params=[True, False], ids=["affine", "no-affine"])
def results(request):
    return request.param, spawn(_worker, 4, request.param, timeout_s=120)


def test_each_rank_gets_its_block_of_the_single_device_layer_norm_and_gradients(results):
    affine, res = results
    for rank, r in enumerate(res):
        assert r["out"] < 1e-12, f"rank {rank}: output off by {r['out']}"
        assert r["dx"] < 1e-12, f"rank {rank}: input gradient off by {r['dx']}"
        if affine:
            assert r["dw"] < 1e-12 and r["db"] < 1e-12, f"rank {rank}: weight/bias gradients off ({r['dw']}, {r['db']})"


def test_only_per_row_statistics_move(results):
    _, res = results
    for rank, r in enumerate(res):
        # one exchange forward (mean, M2), one backward (two sums): 2 values for each of this
        # rank's rows (its grid row's half of dim 1), never a block of the activation
        assert r["gathered"] == [(1, FULL[0], FULL[1] // 2, 2)] * 2, f"rank {rank}: {r['gathered']}"


def _bias_worker(rank, world):
    import torch.distributed as dist

    from stpc.runtime import grid_bias_add

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(FULL, generator=gen, dtype=torch.float64)
    b = torch.randn(FULL[-1], generator=gen, dtype=torch.float64)
    dy = torch.randn(FULL, generator=gen, dtype=torch.float64)
    lx, lb = shard_tensor(x, TOK, (world,), (rank,)).clone().requires_grad_(), b.clone().requires_grad_()
    out = grid_bias_add(lx, lb, dist.group.WORLD.group_name)
    out.backward(shard_tensor(dy, TOK, (world,), (rank,)))
    total = lb.grad.clone()
    dist.all_reduce(total)
    return (torch.equal(out.detach(), shard_tensor(x + b, TOK, (world,), (rank,))),
            torch.equal(lx.grad, shard_tensor(dy, TOK, (world,), (rank,))),
            (total - dy.sum((0, 1))).abs().max().item())


def test_a_whole_bias_adds_its_grid_column_slice_and_its_gradient_sums_whole():
    for rank, (value_ok, dx_ok, db_err) in enumerate(spawn(_bias_worker, 4, timeout_s=120)):
        assert value_ok and dx_ok, f"rank {rank}: wrong block (value {value_ok}, gradient {dx_ok})"
        assert db_err < 1e-12, f"rank {rank}: the bias gradient, summed over ranks, is off by {db_err}"


def _rms_worker(rank, world):
    import torch.distributed as dist

    import stpc.runtime.grid_norm as grid_norm
    from stpc.runtime import grid_column, grid_rms_norm

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(FULL, generator=gen, dtype=torch.float64) * 3 + 1
    w = torch.randn(FULL[-1], generator=gen, dtype=torch.float64)
    dy = torch.randn(FULL, generator=gen, dtype=torch.float64)
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    # (Llama's RMSNorm as stpc.trace leaves it: aten's rms_norm without its weight, then the mul)
    ref = torch.ops.aten.rms_norm.default(ref_x, [FULL[-1]], None, 1e-5) * ref_w
    ref.backward(dy)

    gathered, real_ag = [], grid_norm._ag

    def recording_ag(t, dim, group):
        gathered.append(tuple(t.shape))
        return real_ag(t, dim, group)

    grid_norm._ag = recording_ag
    try:
        lx, lw = shard_tensor(x, TOK, (world,), (rank,)).clone().requires_grad_(), w.clone().requires_grad_()
        out = grid_rms_norm(lx, 1e-5, name) * grid_column(lw, name)
        out.backward(shard_tensor(dy, TOK, (world,), (rank,)))
    finally:
        grid_norm._ag = real_ag
    total = lw.grad.clone()
    dist.all_reduce(total)
    return {"out": (out.detach() - shard_tensor(ref.detach(), TOK, (world,), (rank,))).abs().max().item(),
            "dx": (lx.grad - shard_tensor(ref_x.grad, TOK, (world,), (rank,))).abs().max().item(),
            "dw": (total - ref_w.grad).abs().max().item(), "gathered": gathered,
            "column": torch.equal(grid_column(w, name), w.view(2, -1)[rank % 2])}


def test_an_rms_norm_in_grid_layout_matches_single_device_and_moves_one_value_per_row():
    for rank, r in enumerate(spawn(_rms_worker, 4, timeout_s=120)):
        assert r["out"] < 1e-12 and r["dx"] < 1e-12, f"rank {rank}: output/input gradient off ({r['out']}, {r['dx']})"
        assert r["dw"] < 1e-12, f"rank {rank}: the weight gradient, summed over ranks, is off by {r['dw']}"
        assert r["column"], f"rank {rank}: grid_column is not its grid column's slice"
        # the sum of squares forward, the sum of dy * xhat backward: 1 value per local row each
        assert r["gathered"] == [(1, FULL[0], FULL[1] // 2, 1)] * 2, f"rank {rank}: {r['gathered']}"


def _not_a_grid_worker(rank, world):
    import torch.distributed as dist

    from stpc.runtime import grid_bias_add, grid_column, grid_layer_norm, grid_rms_norm

    name, x, w = dist.group.WORLD.group_name, torch.ones(2, 4, 6), torch.ones(12)
    said = []
    for call in (lambda: grid_layer_norm(x, w, w, 1e-5, name), lambda: grid_bias_add(x, w, name),
                 lambda: grid_rms_norm(x, 1e-5, name), lambda: grid_column(w, name)):
        try:
            call()
        except ValueError as e:
            said.append(str(e))
    return said


def test_a_group_that_forms_no_grid_is_an_error_before_any_exchange():
    # 2 ranks are no 2^k x 2^k grid: both ops say so on every rank, none waits on a collective
    for rank, said in enumerate(spawn(_not_a_grid_worker, 2, timeout_s=60)):
        assert len(said) == 4 and all("4, 16, 64" in s and "has 2" in s for s in said), (rank, said)
