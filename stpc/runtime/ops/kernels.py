"""The fused partial matmul of one ring step: ``out (+)= a @ b``.

Every ring schedule in :mod:`stpc.runtime.ops.ring` is a loop of "multiply the block I
hold into one slice of the output (or of an accumulator)". Doing that with
``out[slice] = a @ b`` allocates a temporary per step and copies it; the
kernel here writes (or accumulates) straight into the strided output slice,
accumulating in fp32.

Dispatch (:func:`ring_step_matmul`):

- CUDA tensors -> cuBLAS by default (``addmm_``/``mm``/``baddbmm_``/``bmm`` with
  ``out=``: they too write a strided output slice in place, without a temporary), the
  Triton kernel where :func:`set_ring_kernel` (or ``STPC_RING_KERNEL=triton`` in the
  environment) asks for it. Measured on an H200 (bf16, the ring steps of llama2-7b on 4
  and 8 devices: ``python -m stpc bench kernel``, benchmarks/RESULTS.md), the autotuned
  Triton kernel's GEMMs run at 0.61-1.12x of cuBLAS's speed in GPU time (geo-mean 0.88x,
  in CUDA graphs), but one call from Python costs 50-95 us to launch (the autotuner's wrapper
  and Triton's launcher) against ``addmm_``'s 8-20, so an eager ring step, launched per
  call, runs at 0.54x: it is not the default. (The H100 runs of the tenth session timed
  single calls only, their launch included: 0.47x and 0.53x.)
- anything else -> plain torch, because ``torch.compile`` of a graph holding a Triton
  op fails on CPU (the fake-tensor run reaches the interpreter), and the interpreter is
  far too slow for real work anyway. (Tried and reverted, the thirty-ninth session: on
  CPU, a batched block that does not fold to rows as one 2-D GEMM into a temporary and a
  copy into the slice, instead of ``bmm`` with an expanded b. Alone, on one thread, it ran
  a GPT's ring steps at batch 4 from 2% slower to 11% faster by shape; in the fidelity
  bench's ``ag_rs`` plan, on 4 ranks sharing 2 cores, the GEMM time it saved (0.19 s a
  step, profiled) went to the copies and fresh temporaries (+0.17 s in other ops), and
  forward + backward did not move: 5.754 s before, 5.763 s after.)

The Triton kernel itself can be run on CPU tensors for testing with
``TRITON_INTERPRET=1`` in the environment *before this module is imported*
(triton decides at ``@triton.jit`` decoration time whether to interpret), via
:func:`triton_ring_step_matmul`.
"""
from __future__ import annotations

import os

import torch

try:  # triton is an optional dependency: the CPU path never needs it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = ["ring_step_matmul", "triton_ring_step_matmul", "set_ring_kernel", "HAS_TRITON"]

_RING_KERNELS = ("cublas", "triton")
_ring_kernel = os.environ.get("STPC_RING_KERNEL", "cublas")
if _ring_kernel not in _RING_KERNELS:
    raise ValueError(f"STPC_RING_KERNEL={_ring_kernel!r}: one of {', '.join(_RING_KERNELS)} (or unset it)")


def set_ring_kernel(name: str) -> None:
    """Which GEMM runs a ring step on CUDA: ``"cublas"`` (the default: torch's matmul) or
    ``"triton"`` (the kernel below). Both compute the same product (up to summation
    order); ranks may differ, but a ring step waits on the slowest of them."""
    global _ring_kernel
    if name not in _RING_KERNELS:
        raise ValueError(f"set_ring_kernel({name!r}): one of {', '.join(_RING_KERNELS)}")
    if name == "triton" and not HAS_TRITON:
        raise RuntimeError("set_ring_kernel('triton') needs triton; install it (pip install triton)")
    _ring_kernel = name


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
    if out.is_cuda and _ring_kernel == "triton":
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
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # batch offsets in int64: a ring slice of a big activation can exceed 2^31 elements
        bid = tl.program_id(1).to(tl.int64)
        # Tiles in groups of GROUP_M rows: consecutive programs share b's columns and a's
        # rows while they are in L2 (the row-major order re-reads b from HBM per row).
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * num_n
        first_m = (pid // in_group) * GROUP_M
        group_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows and columns past the edge wrap onto valid ones (their results are never
        # stored), so the loads need no row/column mask and pipeline as unmasked loads
        rows = offs_m % M
        cols = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + bid * stride_ab + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:  # the last block's tail reads zeros
                a = tl.load(a_ptrs, mask=offs_k[None, :] + k0 < K, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] + k0 < K, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        o_ptrs = o_ptr + bid * stride_ob + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if ACCUMULATE:
            # add the existing partial sum in fp32 before rounding once
            acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=o_mask)

    def _config(m, n, k, stages, warps):
        return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=stages,
                             num_warps=warps)

    # Tile shapes tried per GEMM shape on a GPU, the first call of each (Triton's matmul
    # tutorial's set for Hopper/Ampere): on an H100 the fixed 64x64x32 tile reached a
    # geo-mean 0.42x of cuBLAS's call time over the kernel bench's shapes, these 0.47-0.53x
    # (the tenth session's runs; in GPU time, on an H200, 0.88x: the module docstring). A config whose shared memory does not fit
    # (fp32's large tiles) is skipped by the autotuner.
    _TUNED_CONFIGS = [
        _config(128, 256, 64, 3, 8), _config(256, 128, 64, 3, 8), _config(128, 128, 64, 4, 8),
        _config(128, 128, 64, 3, 4), _config(64, 256, 32, 4, 4), _config(128, 128, 32, 4, 4),
        _config(128, 64, 32, 4, 4), _config(64, 128, 32, 4, 4), _config(64, 64, 32, 4, 4),
    ]
    # EVEN_K: the inner dim is a whole number of blocks, so no load is masked at all
    _ring_step_mm = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(
        _ring_step_mm_kernel)
    # (restore_value: an accumulating call's output is put back after each trial run)
    _ring_step_mm_tuned = triton.autotune(
        configs=_TUNED_CONFIGS, key=["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "ACCUMULATE"],
        restore_value=["o_ptr"])(_ring_step_mm)


def triton_ring_step_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """The Triton kernel behind :func:`ring_step_matmul`, callable directly.

    Same contract. The tile is ``block_m x block_n x block_k`` where given; otherwise, on
    CUDA, the fastest of ``_TUNED_CONFIGS`` for the shape (autotuned on its first call),
    and 64 x 64 x 32 elsewhere. On CPU tensors it only works with ``TRITON_INTERPRET=1``
    set before this module was imported.
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
    args = (a3, b, o3, m, k, n, a3.stride(0), a3.stride(1), a3.stride(2), b.stride(0), b.stride(1),
            o3.stride(0), o3.stride(1), o3.stride(2))
    if out.is_cuda and block_m is None and block_n is None and block_k is None:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]), batch)  # noqa: E731
        _ring_step_mm_tuned[grid](*args, ACCUMULATE=bool(accumulate), INPUT_PRECISION=precision)
        return out
    block_m, block_n, block_k = block_m or 64, block_n or 64, block_k or 32
    grid = (triton.cdiv(m, block_m) * triton.cdiv(k, block_n), batch)
    _ring_step_mm[grid](*args, ACCUMULATE=bool(accumulate), INPUT_PRECISION=precision,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8)
    return out
