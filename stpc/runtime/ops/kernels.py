"""The fused partial matmul of one ring step: ``out (+)= a @ b``.

Every ring schedule in :mod:`stpc.runtime.ops.ring` is a loop of "multiply the block I
hold into one slice of the output (or of an accumulator)". Doing that with
``out[slice] = a @ b`` allocates a temporary per step and copies it; the
kernel here writes (or accumulates) straight into the strided output slice,
accumulating in fp32.

Dispatch (:func:`ring_step_matmul`):

- CUDA tensors -> the Triton kernel.
- anything else -> plain torch (``mm``/``addmm_``/``bmm``/``baddbmm_`` with
  ``out=``), because ``torch.compile`` of a graph holding a Triton op fails on
  CPU (the fake-tensor run reaches the interpreter), and the interpreter is far
  too slow for real work anyway.

The Triton kernel itself can be run on CPU tensors for testing with
``TRITON_INTERPRET=1`` in the environment *before this module is imported*
(triton decides at ``@triton.jit`` decoration time whether to interpret), via
:func:`triton_ring_step_matmul`.
"""
from __future__ import annotations

import torch

try:  # triton is an optional dependency: the CPU path never needs it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = ["ring_step_matmul", "triton_ring_step_matmul", "HAS_TRITON"]


def _check_shapes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if b.dim() != 2:
        raise ValueError(f"ring_step_matmul: b must be 2-D [n, k], got shape {tuple(b.shape)}")
    if a.dim() not in (2, 3):
        raise ValueError(
            f"ring_step_matmul: a must be [m, n] or [batch, m, n], got shape {tuple(a.shape)}"
        )
    expected = (*a.shape[:-1], b.shape[1])
    if a.shape[-1] != b.shape[0] or tuple(out.shape) != expected:
        raise ValueError(
            f"ring_step_matmul: shapes do not line up: a {tuple(a.shape)} @ b {tuple(b.shape)} "
            f"-> expected out {expected}, got {tuple(out.shape)}"
        )


def ring_step_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``out = a @ b`` (``accumulate=False``) or ``out += a @ b`` (``True``), in place.

    a: ``[m, n]`` or ``[batch, m, n]`` (any strides), b: ``[n, k]``,
    out: ``[m, k]`` / ``[batch, m, k]``, typically a strided slice (view) of a
    larger output; it is written in place and also returned.
    """
    _check_shapes(a, b, out)
    if out.is_cuda and HAS_TRITON:
        return triton_ring_step_matmul(a, b, out, accumulate)
    if a.dim() == 2:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    else:
        # matmul(out=) refuses a strided 3-D out; bmm/baddbmm accept it, and an
        # expanded (stride-0) b costs nothing.
        bb = b.expand(a.shape[0], *b.shape)
        if accumulate:
            out.baddbmm_(a, bb)
        else:
            torch.bmm(a, bb, out=out)
    return out


if HAS_TRITON:

    @triton.jit
    def _ring_step_mm_kernel(
        a_ptr, b_ptr, o_ptr,
        M, N, K,
        stride_ab, stride_am, stride_ak,
        stride_bk, stride_bn,
        stride_ob, stride_om, stride_on,
        ACCUMULATE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # batch offsets in int64: a ring slice of a big activation can exceed 2^31 elements
        bid = tl.program_id(1).to(tl.int64)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + bid * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # masks make any M, N, K legal (not only multiples of the block size)
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k0 < K), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] + k0 < K) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        o_ptrs = o_ptr + bid * stride_ob + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if ACCUMULATE:
            # add the existing partial sum in fp32 before rounding once
            acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=o_mask)


def triton_ring_step_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
) -> torch.Tensor:
    """The Triton kernel behind :func:`ring_step_matmul`, callable directly.

    Same contract. On CPU tensors it only works with ``TRITON_INTERPRET=1`` set
    before this module was imported.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton_ring_step_matmul needs triton; install it (pip install triton)")
    _check_shapes(a, b, out)
    if not (a.dtype == b.dtype == out.dtype):
        raise ValueError(f"triton_ring_step_matmul: dtypes differ: {a.dtype}, {b.dtype}, {out.dtype}")
    a3 = a if a.dim() == 3 else a.unsqueeze(0)
    o3 = out if out.dim() == 3 else out.unsqueeze(0)
    batch, m, n = a3.shape
    k = b.shape[1]
    if batch == 0 or m == 0 or k == 0:
        return out
    # fp32 operands: honour torch's TF32 switch so the kernel matches torch.matmul
    if a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        precision = "ieee"
    else:
        precision = "tf32" if a.dtype == torch.float32 else "ieee"
    grid = (triton.cdiv(m, block_m) * triton.cdiv(k, block_n), batch)
    _ring_step_mm_kernel[grid](
        a3, b, o3,
        m, k, n,
        a3.stride(0), a3.stride(1), a3.stride(2),
        b.stride(0), b.stride(1),
        o3.stride(0), o3.stride(1), o3.stride(2),
        ACCUMULATE=bool(accumulate),
        INPUT_PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
