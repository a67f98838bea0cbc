"""The ring-step partial matmul: the torch path in-process, the Triton kernel
under the interpreter in a subprocess.

TRITON_INTERPRET is read when ``@triton.jit`` decorates the kernel, i.e. when
stpc.runtime.ops.kernels is first imported; other tests in this process may already
have imported it, so the only reliable way is a fresh interpreter with the
variable set in its environment.
"""
import os
import subprocess
import sys
import textwrap

import numpy
import pytest
import torch

from stpc.runtime.ops.kernels import HAS_TRITON, ring_step_matmul

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.runtime.errors import InterpreterError

RTOL = ATOL = 1e-5


def _cases():
    """(a, b, out, out_slice, accumulate) covering 2-D/3-D, strided a and out,
    and sizes that are not multiples of the kernel's 64/64/32 blocks (rows and columns
    past the edge, with an inner dim that is a whole number of blocks and one that is not)."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cases = []
    for m, n, k in [(1, 1, 1), (70, 45, 33), (64, 32, 64), (130, 97, 65), (5, 200, 3), (70, 64, 33)]:
        out = rnd(m + 20, k)
        cases.append((rnd(m, n), rnd(n, k), out, (slice(10, 10 + m),), False))
        cases.append((rnd(m, n), rnd(n, k), out.clone(), (slice(10, 10 + m),), True))
    # transposed (non-contiguous) a, as the dW steps use it
    cases.append((rnd(40, 70).t(), rnd(40, 19), rnd(70, 19), (slice(None),), True))
    # batched: a [B, m, n] into a strided row-slice of out [B, M, k]
    out3 = rnd(3, 50, 17)
    cases.append((rnd(3, 20, 45), rnd(45, 17), out3, (slice(None), slice(7, 27)), False))
    cases.append((rnd(3, 20, 45), rnd(45, 17), out3.clone(), (slice(None), slice(7, 27)), True))
    return cases


def _check(fn):
    for a, b, out, sl, acc in _cases():
        before = out.clone()
        expected = before.double()
        prod = a.double() @ b.double()
        expected[sl] = prod + (expected[sl] if acc else 0)
        ret = fn(a, b, out[sl], acc)
        assert ret.data_ptr() == out[sl].data_ptr(), "must write in place into the given slice"
        # the whole out, so writes outside the slice are caught too
        torch.testing.assert_close(out.double(), expected, rtol=RTOL, atol=ATOL)


def test_torch_path_matches_matmul():
    _check(ring_step_matmul)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="do not line up"):
        ring_step_matmul(torch.zeros(3, 4), torch.zeros(5, 2), torch.zeros(3, 2), False)
    with pytest.raises(ValueError, match="b must be 2-D"):
        ring_step_matmul(torch.zeros(3, 4), torch.zeros(1, 4, 2), torch.zeros(3, 2), False)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_kernel_under_interpreter():
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, {tests!r})
        import torch
        import triton
        from stpc.runtime.ops import kernels
        from test_kernels import _check
        # the env var took effect: the kernel is the interpreter's, not a GPU JIT
        assert type(kernels._ring_step_mm_kernel).__name__ == "InterpretedFunction", type(kernels._ring_step_mm_kernel)
        from test_kernels import interpreter_takes_scalar_ranges
        if not interpreter_takes_scalar_ranges():
            print("UPSTREAM-INTERPRETER-BUG")
            sys.exit(0)
        _check(kernels.triton_ring_step_matmul)
        # small blocks: many programs per dim and several K iterations, with edges
        _check(lambda a, b, o, acc: kernels.triton_ring_step_matmul(a, b, o, acc, 16, 16, 16))
        print("KERNEL-OK")
        """
    ).format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0 and "UPSTREAM-INTERPRETER-BUG" in proc.stdout:
        pytest.skip(f"this Triton's interpreter (triton {triton.__version__}, numpy {numpy.__version__}) cannot "
                    f"loop over a scalar argument: triton-lang/triton#9171, fixed by #9172 (a GPU image's "
                    f"Triton 3.6 with NumPy 2.5); CI's Triton has the fix")
    assert proc.returncode == 0 and "KERNEL-OK" in proc.stdout, proc.stdout + proc.stderr


def interpreter_takes_scalar_ranges() -> bool:
    """Whether Triton's interpreter (``TRITON_INTERPRET=1`` in this process) runs ``range``
    over a scalar kernel argument. Its ``__index__`` took ``int()`` of a one-element array,
    which NumPy 2.4 made an error (triton-lang/triton#9171, fixed upstream by #9172): with
    such a pair every kernel with a loop bound by an argument fails, ours included."""
    @triton.jit
    def _count(out_ptr, n):
        total = 0
        for _ in range(0, n, 1):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _count[(1,)](out, 3)
    except InterpreterError as e:
        if "0-dimensional arrays" in str(e):
            return False
        raise
    assert out.item() == 3, out
    return True


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
def test_triton_kernel_on_cuda():
    # the compiled kernel, fp32 without TF32, on the interpreter's cases: fixed tiles, and the
    # autotuned one (a first call per shape tries every config: slow, so three shapes only)
    from stpc.runtime.ops import kernels

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for i, (a, b, out, sl, acc) in enumerate(_cases()):
            for blocks in [(16, 16, 16), (64, 64, 32)] + ([()] if i in (11, 12, 13) else []):
                o, a_, b_ = out.cuda(), a.cuda(), b.cuda()
                expected = o.double()
                expected[sl] = a_.double() @ b_.double() + (expected[sl] if acc else 0)
                kernels.triton_ring_step_matmul(a_, b_, o[sl], acc, *blocks)
                torch.testing.assert_close(o.double(), expected, rtol=RTOL, atol=ATOL)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_ring_kernel_choice_is_checked():
    from stpc.runtime.ops import kernels

    with pytest.raises(ValueError, match="one of cublas, triton"):
        kernels.set_ring_kernel("cutlass")
    before = kernels._ring_kernel
    try:
        if HAS_TRITON:
            kernels.set_ring_kernel("triton")
            assert kernels._ring_kernel == "triton"
        kernels.set_ring_kernel("cublas")
        assert kernels._ring_kernel == "cublas"
    finally:
        kernels._ring_kernel = before
    env = dict(os.environ, STPC_RING_KERNEL="cutlass")
    proc = subprocess.run([sys.executable, "-c", "import stpc.runtime.ops.kernels"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "STPC_RING_KERNEL='cutlass'" in proc.stderr
