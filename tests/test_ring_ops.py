"""AG-ring and RS-ring custom ops on real gloo ranks (2 and 4).

One spawn per world size runs every check and reports each by name; the
pytest items below only read the report, so a failure names its check while
the suite pays the process start-up once. References are float64 single-device
matmuls; the ops run in float32 and must agree to rtol=atol=1e-5.
"""
import functools
import os
import sys

import pytest
import torch

from stpc.runtime.launch import spawn

sys.path.insert(0, os.path.dirname(__file__))
from _opcheck import P2POnly as _P2PCounter  # noqa: E402
from _opcheck import cmp as _cmp  # noqa: E402

pytestmark = pytest.mark.multirank

# (gathered/full x shape, gather-or-scatter dim, K): dims divisible by 4
CASES = [
    ((2, 8, 12), 1, 8),     # [B, S, N], the sequence dim: the common SP case
    ((8, 12), 0, 4),        # plain 2-D
    ((4, 3, 2, 12), 0, 8),  # sharded dim with trailing non-contraction dims
    ((3, 8, 12), -2, 12),   # negative dim
]
FWD_CHECKS = ["out", "dx", "dw", "schedule"]
NUMERIC_CHECKS = (
    [f"ag{i}_{c}" for i in range(len(CASES)) for c in FWD_CHECKS]
    + [f"rs{i}_{c}" for i in range(len(CASES)) for c in FWD_CHECKS]
    + ["bad_dim", "rs_not_divisible", "ag_dw_layout", "rs_dw_layout"]
)
# compile and opcheck do not depend on the world size: checked on 2 ranks only
EXTRA_CHECKS = ["compile_aot_eager", "opcheck_ag", "opcheck_rs", "opcheck_ag_bwd", "opcheck_rs_bwd"]
def _full(shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _worker(rank, world, extras, with_inductor):
    import torch.distributed as dist

    import stpc.runtime.ops as O

    name = dist.group.WORLD.group_name
    P = world
    res = {}
    gen = torch.Generator().manual_seed(1234)
    for ci, (xshape, dim, K) in enumerate(CASES):
        g = dim % len(xshape)
        N = xshape[-1]
        x = _full(xshape, gen)
        w = _full((N, K), gen)
        gout = _full((*xshape[:-1], K), gen)
        out_full = x @ w
        dx_full = gout @ w.t()
        dw_full = x.reshape(-1, N).t() @ gout.reshape(-1, K)
        s, n, k = xshape[g] // P, N // P, K // P

        # AG: x sharded on dim g, w (and out) column-sharded on K
        xl = x.narrow(g, rank * s, s).float().requires_grad_()
        wl = w[:, rank * k:(rank + 1) * k].float().requires_grad_()
        with _P2PCounter() as cnt:
            out = O.ring_allgather_matmul(xl, wl, dim, name)
            fwd_sends = cnt.sends
            out.backward(gout[..., rank * k:(rank + 1) * k].float())
        res[f"ag{ci}_out"] = _cmp(out, out_full[..., rank * k:(rank + 1) * k])
        res[f"ag{ci}_dx"] = _cmp(xl.grad, dx_full.narrow(g, rank * s, s))
        res[f"ag{ci}_dw"] = _cmp(wl.grad, dw_full[:, rank * k:(rank + 1) * k])
        # forward: P-1 block transfers; backward: P-1 x blocks + P-1 accumulators
        expect = (P - 1, 3 * (P - 1))
        res[f"ag{ci}_schedule"] = (
            None if (fwd_sends, cnt.sends) == expect else f"sends (fwd, total) {(fwd_sends, cnt.sends)} != {expect}"
        )

        # RS: contraction dim sharded, out scattered on dim g
        xl = x[..., rank * n:(rank + 1) * n].float().requires_grad_()
        wl = w[rank * n:(rank + 1) * n].float().requires_grad_()
        with _P2PCounter() as cnt:
            out = O.ring_matmul_reducescatter(xl, wl, dim, name)
            fwd_sends = cnt.sends
            out.backward(gout.narrow(g, rank * s, s).float())
        res[f"rs{ci}_out"] = _cmp(out, out_full.narrow(g, rank * s, s))
        res[f"rs{ci}_dx"] = _cmp(xl.grad, dx_full[..., rank * n:(rank + 1) * n])
        res[f"rs{ci}_dw"] = _cmp(wl.grad, dw_full[rank * n:(rank + 1) * n])
        expect = (P - 1, 2 * (P - 1))
        res[f"rs{ci}_schedule"] = (
            None if (fwd_sends, cnt.sends) == expect else f"sends (fwd, total) {(fwd_sends, cnt.sends)} != {expect}"
        )

    # a linear's weight W [K, N] reaches the ring as W.t(): its gradient comes back in W's
    # layout, contiguous (the optimizer's elementwise kernels crawl over a transposed one).
    # Seen by a hook, before autograd's accumulation fixes a plain leaf's layout with a copy;
    # a DTensor parameter's local gradient gets no such fix
    xshape, dim, K = CASES[0]
    g, N = dim % len(xshape), xshape[-1]
    x, w = _full(xshape, gen), _full((N, K), gen)
    gout = _full((*xshape[:-1], K), gen)
    dw_full = x.reshape(-1, N).t() @ gout.reshape(-1, K)
    s, n, k = xshape[g] // P, N // P, K // P
    for key, wpart, xl, go, ref in (
            ("ag", w[:, rank * k:(rank + 1) * k], x.narrow(g, rank * s, s), gout[..., rank * k:(rank + 1) * k],
             dw_full[:, rank * k:(rank + 1) * k]),
            ("rs", w[rank * n:(rank + 1) * n], x[..., rank * n:(rank + 1) * n], gout.narrow(g, rank * s, s),
             dw_full[rank * n:(rank + 1) * n])):
        W = wpart.t().contiguous().float().requires_grad_()   # [K, N]: an nn.Linear's weight
        seen = []
        W.register_hook(seen.append)
        op = O.ring_allgather_matmul if key == "ag" else O.ring_matmul_reducescatter
        op(xl.float(), W.t(), dim, name).backward(go.float())
        res[f"{key}_dw_layout"] = (_cmp(seen[0].t(), ref) or
                                   (None if seen[0].is_contiguous() else f"W's gradient strides {seen[0].stride()}"))

    # clear errors, raised before any P2P (so every rank raises, nothing hangs)
    try:
        O.ring_allgather_matmul(torch.randn(4, 6), torch.randn(6, 3), -1, name)
        res["bad_dim"] = "no error for gather_dim = the contraction dim"
    except ValueError as e:
        res["bad_dim"] = None if "contraction" in str(e) else f"unclear message: {e}"
    try:
        O.ring_matmul_reducescatter(torch.randn(4 * P + 1, 6), torch.randn(6, 3), 0, name)
        res["rs_not_divisible"] = "no error for a scatter dim not divisible by P"
    except ValueError as e:
        res["rs_not_divisible"] = None if "divisible" in str(e) else f"unclear message: {e}"
    if not extras:
        return res

    # torch.compile: a sequence-parallel MLP, AG-ring then RS-ring, in one graph
    B, S, H, F = 2, 8, 12, 16
    x = _full((B, S, H), gen)
    w1 = _full((H, F), gen)
    w2 = _full((F, H), gen)
    s, f = S // P, F // P

    def mlp(xl, w1l, w2l):
        h = O.ring_allgather_matmul(xl, w1l, 1, name)
        return O.ring_matmul_reducescatter(torch.relu(h), w2l, 1, name)

    def run(fn):
        xl = x[:, rank * s:(rank + 1) * s].float().requires_grad_()
        w1l = w1[:, rank * f:(rank + 1) * f].float().requires_grad_()
        w2l = w2[rank * f:(rank + 1) * f].float().requires_grad_()
        y = fn(xl, w1l, w2l)
        (y * y).sum().backward()
        return y, xl.grad, w1l.grad, w2l.grad

    eager = run(mlp)
    # the eager ring result must itself be right, else agreeing with it proves nothing
    ref_y = (torch.relu(x @ w1) @ w2)[:, rank * s:(rank + 1) * s]
    err = _cmp(eager[0], ref_y)
    backends = ["aot_eager"] + (["inductor"] if with_inductor else [])
    for backend in backends:
        torch._dynamo.reset()
        try:
            compiled = run(torch.compile(mlp, backend=backend, fullgraph=True))
            errs = [_cmp(c, e.double()) for c, e in zip(compiled, eager)]
            res[f"compile_{backend}"] = err or next((e for e in errs if e), None)
        except Exception as e:  # noqa: BLE001 - report, do not kill the other checks
            res[f"compile_{backend}"] = f"{type(e).__name__}: {e}"

    # opcheck: schema, fake kernel vs real, autograd registration, AOT dispatch
    xs = torch.randn(2, 4, 12, requires_grad=True)
    checks = {
        "opcheck_ag": (torch.ops.stpc.ring_allgather_matmul.default,
                       (xs, torch.randn(12, 4, requires_grad=True), 1, name)),
        "opcheck_rs": (torch.ops.stpc.ring_matmul_reducescatter.default,
                       (torch.randn(2, 8, 6, requires_grad=True), torch.randn(6, 4, requires_grad=True), 1, name)),
        "opcheck_ag_bwd": (torch.ops.stpc.ring_allgather_matmul_backward.default,
                           (torch.randn(2, 4 * P, 4), torch.randn(2, 4, 12), torch.randn(12, 4), 1, name)),
        "opcheck_rs_bwd": (torch.ops.stpc.ring_matmul_reducescatter_backward.default,
                           (torch.randn(2, 8 // P, 4), torch.randn(2, 8, 6), torch.randn(6, 4), 1, name)),
    }
    for key, (op, args) in checks.items():
        try:
            torch.library.opcheck(op, args)
            res[key] = None
        except Exception as e:  # noqa: BLE001
            res[key] = f"{type(e).__name__}: {e}"

    return res


def _report(world, extras=False, with_inductor=False):
    return _spawn_once(world, extras, with_inductor)


@functools.lru_cache(maxsize=None)
def _spawn_once(world, extras, with_inductor):
    # a failed spawn is cached too (as its exception): otherwise every one of
    # the parametrized items below would re-run the whole spawn
    try:
        return spawn(_worker, world, extras, with_inductor, timeout_s=240)
    except Exception as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("check", NUMERIC_CHECKS)
def test_ring_op_numerics(world, check):
    # the 2-rank run also does the extra checks (one spawn for both)
    _assert_passed(_report(world, extras=world == 2), check, world)


@pytest.mark.parametrize("check", EXTRA_CHECKS)
def test_ring_op_compile_and_opcheck(check):
    _assert_passed(_report(2, extras=True), check, 2)


@pytest.mark.slow
def test_ring_ops_under_inductor():
    # slow: a cold inductor compile of the fwd+bwd graph takes ~15 s per rank on 2 cores
    _assert_passed(_report(2, extras=True, with_inductor=True), "compile_inductor", 2)


def _assert_passed(reports, check, world):
    if isinstance(reports, Exception):
        raise reports
    for rank, report in enumerate(reports):
        assert check in report, f"check {check} did not run"
        assert report[check] is None, f"rank {rank}/{world}: {check}: {report[check]}"
