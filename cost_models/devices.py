"""Accelerator specifications.

Units: FLOP/s for ``peak_flops``, bytes/s for ``mem_bw``, bytes for ``mem_bytes``.

Peak numbers are the vendors' dense (no structured sparsity) tensor-core figures
for SXM parts. ``efficiency`` is the fraction of peak a large, well-shaped GEMM
reaches in practice (cuBLAS on a big square bf16 matmul lands at 70-80% of
peak on A100/H100); the roofline in :mod:`compute` divides by
``peak * efficiency``. A calibration profile replaces both with a measured
throughput and sets ``efficiency=1``.

Smaller GEMMs run further below peak. ``gemm_ramp_s`` shapes that curve: a GEMM of ``f``
FLOPs runs at ``rate * f / (f + rate * gemm_ramp_s)`` (``rate`` the large-GEMM figure
above), i.e. it takes ``gemm_ramp_s`` longer than the large-GEMM rate says, so its
efficiency is half at ``f = rate * gemm_ramp_s``. The GPU default is the NVIDIA Matrix
Multiplication Background User's Guide's wave quantization (DU-09799-001, ch. 3): cuBLAS
computes 256x128 output tiles, one per SM at a time, so a GEMM smaller than one wave of
tiles leaves SMs idle and a partial last wave costs a whole one; averaged over sizes,
efficiency reaches one half near half a wave. Half a wave of 256x128 tiles at the
contraction depth of the 7B models (K = 4096) is ``SMs * 256 * 128 * 4096`` FLOPs
(:func:`wave_ramp_s`); a GEMM with a shallower K ramps faster, a deeper one slower (a named
simplification: the curve is over FLOPs, not shape). ``python -m stpc calibrate`` measures
the ramp of its own machine from GEMMs of several sizes.

On Hopper both figures are measured instead (``HOPPER_GEMM_EFFICIENCY``,
``HOPPER_GEMM_RAMP_S``): held against 324 bf16 cuBLAS GEMMs of PrimePar's cells on an H200,
the guesses above charged the 1-10 GFLOP GEMMs (ring steps, split linears) 75% too much and
the large ones 5% too little. So is attention's slowdown over that roofline
(``HOPPER_OP_SLOWDOWN``: 1.39x causal, 11.8x with an ALiBi mask). The V100 and A100 presets
keep the guesses and charge attention its roofline (unmeasured here).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

# Accepted spellings of dtype names, so callers may pass "float32", "torch.bfloat16", ...
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "f32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "f16": "fp16",
}


def canonical_dtype(dtype) -> str:
    """Map a dtype (``torch.dtype`` or string) to one of fp32/tf32/bf16/fp16."""
    key = str(dtype)
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, tf32, bf16, fp16") from None


# A large, well-shaped GEMM's share of peak on a GPU (module docstring: cuBLAS lands at 70-80%).
GEMM_EFFICIENCY = 0.75


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    name:        identifier, e.g. ``"H100-SXM"``
    peak_flops:  dtype name -> peak dense FLOP/s (keys fp32, tf32, bf16, fp16)
    mem_bw:      device memory bandwidth, bytes/s
    mem_bytes:   device memory capacity, bytes
    efficiency:  achievable fraction of ``peak_flops`` for large GEMMs (0 < e <= 1)
    gemm_ramp_s: what a GEMM takes beyond its FLOPs at the large-GEMM rate, seconds (the
                 efficiency curve over GEMM size; module docstring)
    gemm_ramps:  dtype name -> its own ramp, where measured (a calibration profile fits one
                 per dtype); other dtypes use ``gemm_ramp_s``
    op_slowdown: aten op name (``planner.costs.slowdown_key``: ``str(node.target)``, e.g.
                 ``"aten.gelu.default"``, or a variant run by other kernels, e.g.
                 ``"aten.gelu.default[tanh]"``, which falls back to its op's) -> its
                 measured time over its roofline time, where measured (``calibrate`` times
                 each op the built-in models use, forward + backward, on its own machine:
                 a CPU runs erf, exp and attention's softmax far below its memory
                 bandwidth); other ops take their roofline time (factor 1)
    batch_reread_bw: bytes/s at which a batched GEMM whose elements share one weight (an
                 expanded, stride-0 operand) reads that weight again for every element past
                 the first, where measured (``calibrate``'s batched-block probe: on a CPU,
                 ``torch.bmm`` packs the shared weight anew per element). A ring step whose
                 activation block does not fold to rows runs as such a GEMM
                 (``runtime.ops.kernels.ring_step_matmul``); None: no extra cost (the
                 presets: cuBLAS's strided batched GEMM, an assumption, not measured)
    batch_reread_cached_bytes: the part of such a shared weight read again for free: it
                 stays in the cache between elements (``calibrate`` fits it from the probe
                 at two weight sizes: on the development VM, 1 MiB of L2 a core, a 1 MiB
                 weight was read again at 16-26 GB/s, a 4 MiB one at 6-8 GB/s); 0: none
    fresh_alloc_bytes: the size from which every allocation is memory new from the operating
                 system, each time, where the allocator does not keep such blocks: on a CPU,
                 glibc's malloc maps a block of its mmap threshold or more afresh and unmaps it
                 when freed, and the threshold it raises as blocks are freed stops at
                 ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on 64-bit (glibc's malloc/malloc.c;
                 ``MALLOC_MMAP_THRESHOLD_`` sets it instead). None: the allocator caches every
                 size (CUDA's caching allocator; the presets)
    fresh_page_bw: bytes/s at which such fresh memory is first touched, beyond the write
                 itself (the kernel faulting in and zeroing each page; ``calibrate``'s
                 fresh-allocation probe: a clone above the threshold against a copy into a
                 warm buffer of its size, every rank at once); None: no extra cost
    """

    name: str
    peak_flops: dict = field(hash=False)
    mem_bw: float
    mem_bytes: float
    efficiency: float = GEMM_EFFICIENCY
    gemm_ramp_s: float = 0.0
    gemm_ramps: dict = field(default_factory=dict, hash=False)
    op_slowdown: dict = field(default_factory=dict, hash=False)
    batch_reread_bw: float | None = None
    batch_reread_cached_bytes: float = 0.0
    fresh_alloc_bytes: float | None = None
    fresh_page_bw: float | None = None

    def __post_init__(self):
        missing = {"fp32", "tf32", "bf16", "fp16"} - set(self.peak_flops)
        if missing:
            raise ValueError(f"DeviceSpec {self.name!r}: peak_flops lacks {sorted(missing)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"DeviceSpec {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.gemm_ramp_s < 0 or any(v < 0 for v in self.gemm_ramps.values()):
            raise ValueError(f"DeviceSpec {self.name!r}: gemm_ramp_s and gemm_ramps must be >= 0, got "
                             f"{self.gemm_ramp_s} and {self.gemm_ramps}")
        if any(not v > 0 for v in self.op_slowdown.values()):
            raise ValueError(f"DeviceSpec {self.name!r}: op_slowdown factors must be positive, got "
                             f"{self.op_slowdown}")
        if self.mem_bw <= 0 or self.mem_bytes <= 0:
            raise ValueError(f"DeviceSpec {self.name!r}: mem_bw and mem_bytes must be positive")
        if self.batch_reread_bw is not None and not self.batch_reread_bw > 0:
            raise ValueError(f"DeviceSpec {self.name!r}: batch_reread_bw must be positive or None, got "
                             f"{self.batch_reread_bw}")
        if not self.batch_reread_cached_bytes >= 0:
            raise ValueError(f"DeviceSpec {self.name!r}: batch_reread_cached_bytes must be >= 0, got "
                             f"{self.batch_reread_cached_bytes}")
        for name in ("fresh_alloc_bytes", "fresh_page_bw"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {name} must be positive or None, got {v}")

    def achievable_flops(self, dtype="fp32") -> float:
        """FLOP/s a large matmul reaches in ``dtype`` (peak x efficiency)."""
        return self.peak_flops[canonical_dtype(dtype)] * self.efficiency

    def ramp_s(self, dtype="fp32") -> float:
        """The GEMM ramp of ``dtype`` (``gemm_ramps``, else ``gemm_ramp_s``)."""
        return self.gemm_ramps.get(canonical_dtype(dtype), self.gemm_ramp_s)


T = 1e12
GB = 1e9
GiB = 2**30
MiB = 2**20


# The wave-quantization ramp (module docstring): half a wave of 256 x 128 output tiles at
# K = 4096, one tile per SM, at the dense fp16/bf16 tensor-core rate.
WAVE_TILE_FLOPS = 256 * 128 * 4096   # half of one tile's 2 * 256 * 128 * 4096 FLOPs


# Hopper's GEMM curve, measured: `python benchmarks/gemm_curve_check.py` on one H200 (torch
# 2.11 with CUDA 13.0's cuBLAS; twenty-eighth session, RESULTS.md's GEMM-curve section), 324 bf16
# GEMMs (the forward, input- and weight-gradient shapes of llama2-7b's, llama2-70b's and
# opt-175b's MLP linears over 256-16384 tokens and 1-64 weight shards: 0.5 GFLOP to 20 TFLOP),
# fitted by cost_models.fit_gemm_curve: 72.1% of the dense bf16 peak, 10.1 us ramp (half that
# rate at 7.2 GFLOP; the wave guess put it at 17.7). The H100 SXM is the same GH100 chip (132
# SMs, the same clocks and power limit), so its preset takes the H200's figures; fp32 and fp16
# take bf16's (a named simplification, measured after: fp32 GEMMs without TF32 within 5%
# (median +3%), fp16 ones 4% slower than bf16, so modelled 7% fast; RESULTS.md).
HOPPER_GEMM_EFFICIENCY = 0.721
HOPPER_GEMM_RAMP_S = 10.1e-6

# Attention on Hopper, measured: `python benchmarks/cuda_check.py --skip parity single gloo
# memory` (llama2-7b, and `--bf16 bloom-7b1 4 4 2048`) on one H200 (torch 2.11, CUDA 13.0;
# twenty-ninth session, RESULTS.md's CUDA section): the device time of the attention kernels
# of one profiled forward + backward of 4 layers at batch 4 x seq 2048 (32 heads of 128),
# over what the planner charged them at slowdown 1 (the roofline at the GEMM rate above,
# forward and backward each of the forward's FLOPs, unmasked FLOPs however causal):
# causal attention without a mask, which torch runs by cuDNN's sm90 flash kernels, 4.28 ms
# against 3.08 (1.39x: its backward does 2.5x the forward's work, the causal half skipped);
# with BLOOM's ALiBi bias as a mask, torch's memory-efficient kernels (CUTLASS, built for
# sm80) 36.5 ms against the same 3.08 (11.8x). One size, a named simplification (as
# `calibrate`'s probes): eager's figures (inductor's, the same kernels: 1.44x and 12.0x).
HOPPER_OP_SLOWDOWN = {"aten.scaled_dot_product_attention.default": 1.39,
                      "aten.scaled_dot_product_attention.default[attn_mask]": 11.8}


def wave_ramp_s(sms: int, fp16_flops: float, efficiency: float = GEMM_EFFICIENCY) -> float:
    """``gemm_ramp_s`` of a GPU with ``sms`` streaming multiprocessors: half a wave of
    cuBLAS tiles at the large-GEMM fp16 rate."""
    return sms * WAVE_TILE_FLOPS / (fp16_flops * efficiency)


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # non-POSIX: a conservative 16 GiB
        return 16.0 * GiB


DEVICES: dict[str, DeviceSpec] = {
    # Memory capacities are the sold figure read as GiB (an "80GB" H100 reports 81559 MiB in
    # nvidia-smi, a "32GB" V100 32510 MiB: binary gigabytes less the driver's reserve, which
    # the planner's budget headroom, Cluster.usable_memory_fraction, covers).
    # H100 SXM5: 67 TF fp32, 494.7 TF tf32, 989.4 TF bf16/fp16 (dense), HBM3 3.35 TB/s, 80 GiB,
    # 132 SMs; its GEMM curve the H200's, measured (HOPPER_GEMM_*).
    "H100-SXM": DeviceSpec("H100-SXM", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T,
                                        "fp16": 989.4 * T}, mem_bw=3.35e12, mem_bytes=80 * GiB,
                            efficiency=HOPPER_GEMM_EFFICIENCY, gemm_ramp_s=HOPPER_GEMM_RAMP_S,
                            op_slowdown=HOPPER_OP_SLOWDOWN),
    # H200 SXM: H100 compute, HBM3e 4.8 TB/s, 141 GB sold: 143771 MiB in nvidia-smi (140.4 GiB,
    # less than 141 GiB), so that figure.
    "H200": DeviceSpec("H200", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T,
                                "fp16": 989.4 * T}, mem_bw=4.8e12, mem_bytes=143771 * MiB,
                        efficiency=HOPPER_GEMM_EFFICIENCY, gemm_ramp_s=HOPPER_GEMM_RAMP_S,
                        op_slowdown=HOPPER_OP_SLOWDOWN),
    # A100 SXM4 80GB: 19.5 TF fp32, 156 TF tf32, 312 TF bf16/fp16, HBM2e 2.039 TB/s, 108 SMs.
    "A100-80GB": DeviceSpec("A100-80GB", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T,
                                          "fp16": 312 * T}, mem_bw=2.039e12, mem_bytes=80 * GiB,
                              gemm_ramp_s=wave_ramp_s(108, 312 * T)),
    # V100 SXM2 32GB: 15.7 TF fp32, 125 TF fp16 tensor cores, 80 SMs. No tf32 and no native bf16
    # (bf16 matmuls run at the fp32 rate there), so both map to the fp32 figure.
    "V100-32GB": DeviceSpec("V100-32GB", {"fp32": 15.7 * T, "tf32": 15.7 * T, "bf16": 15.7 * T,
                                          "fp16": 125 * T}, mem_bw=900 * GB, mem_bytes=32 * GiB,
                              gemm_ramp_s=wave_ramp_s(80, 125 * T)),
    # A generic CPU socket share: order-of-magnitude figures only (a few AVX2 cores); run
    # `python -m stpc calibrate` for real numbers (and the GEMM ramp: none assumed here).
    # Memory is this host's RAM, which all local ranks share.
    "CPU": DeviceSpec("CPU", {"fp32": 100e9, "tf32": 100e9, "bf16": 50e9, "fp16": 25e9},
                      mem_bw=20 * GB, mem_bytes=_host_memory_bytes(), efficiency=0.6),
}
_DEVICE_ALIASES = {"h100": "H100-SXM", "h100-sxm": "H100-SXM", "h200": "H200", "a100": "A100-80GB",
                   "a100-80gb": "A100-80GB", "v100": "V100-32GB", "v100-32gb": "V100-32GB",
                   "cpu": "CPU"}


def get_device(name: str) -> DeviceSpec:
    """Look up a device by name (case-insensitive; short forms like ``"h100"`` work)."""
    if name in DEVICES:
        return DEVICES[name]
    key = _DEVICE_ALIASES.get(name.lower())
    if key is None:
        raise KeyError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]
