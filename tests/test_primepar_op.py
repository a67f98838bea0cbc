"""PrimePar P(2^k x 2^k) linear on a real 2x2 grid of gloo ranks (k=1).

Checks: output and both gradients equal the single-device matmul (float64
reference, rtol=atol=1e-5), every gradient comes back in its input's layout,
no collective runs and the P2P count matches the schedule, torch.compile and
opcheck, clear errors. Layout helpers are checked in-process.
"""
import functools
import os
import sys

import pytest
import torch

import stpc.runtime.ops as O
from stpc.runtime.launch import spawn

sys.path.insert(0, os.path.dirname(__file__))
from _opcheck import P2POnly  # noqa: E402
from _opcheck import cmp as _cmp  # noqa: E402

# full shapes: (x [..., M, N], K); all divisible by 2^k = 2 (and by 4 for k=2)
CASES = [((8, 12), 4), ((2, 8, 12), 8), ((3, 4, 8), 12)]
NUMERIC = [f"case{i}_{c}" for i in range(len(CASES)) for c in ("out", "dx", "dw", "schedule")]
EXTRA = ["compile_aot_eager", "opcheck_fwd", "opcheck_bwd", "bad_group_k", "bad_group_size"]


def _worker(rank, world, k, extras):
    import torch.distributed as dist

    import stpc.runtime.ops as O

    name = dist.group.WORLD.group_name
    q = 2 ** k
    r, c = O.primepar_coords(rank, k)
    res = {}
    gen = torch.Generator().manual_seed(7)
    for ci, (xshape, K) in enumerate(CASES):
        N = xshape[-1]
        x = torch.randn(*xshape, generator=gen, dtype=torch.float64)
        w = torch.randn(N, K, generator=gen, dtype=torch.float64)
        g = torch.randn(*xshape[:-1], K, generator=gen, dtype=torch.float64)
        out_full, dx_full = x @ w, g @ w.t()
        dw_full = x.reshape(-1, N).t() @ g.reshape(-1, K)

        xl = O.primepar_shard_input(x, r, c, k).float().requires_grad_()
        wl = O.primepar_shard_weight(w, r, c, k).float().requires_grad_()
        with P2POnly() as counter:
            out = O.primepar_linear(xl, wl, name, k)
            fwd = counter.sends
            out.backward(O.primepar_shard_output(g, r, c, k).float())
        res[f"case{ci}_out"] = _cmp(out, O.primepar_shard_output(out_full, r, c, k))
        # the gradients must be in the layouts of x and w, not one block off
        res[f"case{ci}_dx"] = _cmp(xl.grad, O.primepar_shard_input(dx_full, r, c, k))
        res[f"case{ci}_dw"] = _cmp(wl.grad, O.primepar_shard_weight(dw_full, r, c, k))
        # forward: I and W, q-1 steps each; backward: dO and W q-1 each + the dI
        # shift; gradient: I and dO q-1 each + the accumulator move
        expect = (2 * (q - 1), 2 * (q - 1) + 2 * (q - 1) + 1 + 2 * (q - 1) + 1)
        got = (fwd, counter.sends)
        res[f"case{ci}_schedule"] = None if got == expect else f"sends (fwd, total) {got} != {expect}"
    if not extras:
        return res

    # torch.compile: the op between pointwise ops, forward and backward, must
    # match eager (which is itself checked against the reference first)
    x = torch.randn(2, 8, 12, generator=gen, dtype=torch.float64)
    w = torch.randn(12, 8, generator=gen, dtype=torch.float64)

    def f(xl, wl):
        return torch.tanh(O.primepar_linear(xl * 2.0, wl, name, k))

    def run(fn):
        xl = O.primepar_shard_input(x, r, c, k).float().requires_grad_()
        wl = O.primepar_shard_weight(w, r, c, k).float().requires_grad_()
        y = fn(xl, wl)
        (y * y).sum().backward()
        return y, xl.grad, wl.grad

    eager = run(f)
    err = _cmp(eager[0], O.primepar_shard_output(torch.tanh((2.0 * x) @ w), r, c, k))
    try:
        torch._dynamo.reset()
        compiled = run(torch.compile(f, backend="aot_eager", fullgraph=True))
        res["compile_aot_eager"] = err or next(
            (e for e in (_cmp(a, b.double()) for a, b in zip(compiled, eager)) if e), None
        )
    except Exception as e:  # noqa: BLE001 - report, keep the other checks
        res["compile_aot_eager"] = f"{type(e).__name__}: {e}"

    xb = torch.randn(2, 4, 6, requires_grad=True)
    wb = torch.randn(6, 4, requires_grad=True)
    for key, (op, args) in {
        "opcheck_fwd": (torch.ops.stpc.primepar_linear.default, (xb, wb, name, k)),
        "opcheck_bwd": (torch.ops.stpc.primepar_linear_backward.default,
                        (torch.randn(2, 4, 4), torch.randn(8, 6), torch.randn(6, 4), name, k)),
    }.items():
        try:
            torch.library.opcheck(op, args)
            res[key] = None
        except Exception as e:  # noqa: BLE001
            res[key] = f"{type(e).__name__}: {e}"

    # wrong k for this group: ValueError that says which k fits
    try:
        O.primepar_linear(xb, wb, name, k + 1)
        res["bad_group_k"] = "no error for k not matching the group size"
    except ValueError as e:
        res["bad_group_k"] = None if f"k={k}" in str(e) else f"unclear message: {e}"
    # a group whose size is not a power of 4 (ranks 0, 1 of a new 2-rank group)
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        try:
            O.primepar_linear(xb, wb, sub, 1)
            res["bad_group_size"] = "no error for a 2-rank group"
        except ValueError as e:
            res["bad_group_size"] = None if "4, 16, 64" in str(e) else f"unclear message: {e}"
    else:
        res["bad_group_size"] = None
    # no rank leaves (tearing its connections down) while ranks 0 and 1 still connect
    # their sub-group: under load that race broke the sub-group's gloo mesh set-up
    dist.barrier()
    return res


@functools.lru_cache(maxsize=None)
def _report(k):
    # a failed spawn is cached too (as its exception), so the parametrized
    # items do not each re-run it
    try:
        return spawn(_worker, 4 ** k, k, k == 1, timeout_s=240)
    except Exception as e:  # noqa: BLE001
        return e


def _assert_passed(reports, check):
    if isinstance(reports, Exception):
        raise reports
    for rank, report in enumerate(reports):
        assert check in report, f"check {check} did not run"
        assert report[check] is None, f"rank {rank}: {check}: {report[check]}"


@pytest.mark.multirank
@pytest.mark.parametrize("check", NUMERIC + EXTRA)
def test_primepar_2x2(check):
    _assert_passed(_report(1), check)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("check", NUMERIC)
def test_primepar_4x4(check):
    # 16 ranks on a laptop-class CPU: slow start-up, hence -m slow
    _assert_passed(_report(2), check)


# ---------------------------------------------------------------- layouts (in-process)


@pytest.mark.parametrize("k", [1, 2])
def test_layout_roundtrip_and_cannon_skew(k):
    q = 2 ** k
    x = torch.arange(2 * 4 * q * 3 * q, dtype=torch.float32).reshape(2, 4 * q, 3 * q)
    w = torch.arange(3 * q * 5 * q, dtype=torch.float32).reshape(3 * q, 5 * q)
    o = torch.arange(2 * 4 * q * 5 * q, dtype=torch.float32).reshape(2, 4 * q, 5 * q)
    coords = [O.primepar_coords(rank, k) for rank in range(q * q)]
    assert coords == [(rank // q, rank % q) for rank in range(q * q)]
    xs = [O.primepar_shard_input(x, r, c, k) for r, c in coords]
    ws = [O.primepar_shard_weight(w, r, c, k) for r, c in coords]
    os_ = [O.primepar_shard_output(o, r, c, k) for r, c in coords]
    assert torch.equal(O.primepar_unshard_input(xs, k), x)
    assert torch.equal(O.primepar_unshard_weight(ws, k), w)
    assert torch.equal(O.primepar_unshard_output(os_, k), o)
    # no replication: every block of x and of w is held by exactly one device
    assert len({b.sum().item() for b in xs}) == q * q
    # the forward's first step multiplies matching N slices: x's columns == w's rows
    for (r, c), xb, wb in zip(coords, xs, ws):
        n = (r + c) % q
        assert torch.equal(xb, x[:, r * 4:(r + 1) * 4, n * 3:(n + 1) * 3])
        assert torch.equal(wb, w[n * 3:(n + 1) * 3, c * 5:(c + 1) * 5])


def test_layout_rejects_indivisible_and_wrong_count():
    with pytest.raises(ValueError, match="divide"):
        O.primepar_shard_input(torch.zeros(5, 4), 0, 0, 1)
    with pytest.raises(ValueError, match="expected 4 blocks"):
        O.primepar_unshard_output([torch.zeros(2, 2)] * 3, 1)
