"""Calibration profiles: least-squares alpha-beta fits and the JSON file format.

Pure numpy; the measurement itself (torch.distributed) is ``stpc.cli.calibrate``. Also
:func:`get_cluster`, which resolves a preset name or a profile path to a Cluster.

Profile JSON (version 1)::

    {"version": 1, "name": str, "backend": "gloo"|"nccl", "ranks": int,
     "device": {"name", "peak_flops": {fp32,tf32,bf16,fp16: FLOP/s}, "mem_bw": B/s,
                "mem_bytes": B, "efficiency": 1.0, "gemm_ramp_s": s,      # ramps: optional
                "gemm_ramps": {dtype: s},
                "op_slowdown": {aten op: measured / roofline},        # optional
                "batch_reread_bw": B/s, "batch_reread_cached_bytes": B,   # optional
                "fresh_alloc_bytes": B, "fresh_page_bw": B/s},             # optional
     "matmul": [{"m","n","k","dtype","seconds","flops_per_s"}, ...],
     "link": {"alpha_s": s, "bw_bytes_per_s": B/s},          # joint fit, all collectives
     "collectives": {kind: {"alpha_s", "bw_bytes_per_s", "rel_rms",
                            "samples": [[nbytes, seconds], ...],
                            "bands": [[upper_nbytes, alpha_s, bw_bytes_per_s], ...]}},
     "group_collectives": {n: {kind: {as above}}},          # optional: groups of n < ranks
     "overlap": {"slowdown": float, "ring_step_overhead_s": s, ...}}   # optional

``peak_flops`` is each dtype's large-GEMM rate and ``gemm_ramps`` its ramp (``gemm_ramp_s``:
fp32's), both from :func:`fit_gemm_curve` over the timed ``matmul`` rows (profiles written
before the ramp was fitted lack them: no ramp, and the best row's rate).

``op_slowdown`` (``DeviceSpec.op_slowdown``; profiles written before it was measured lack
it, and every op takes its roofline time) is, per non-GEMM aten op the built-in models use,
its measured forward + backward time over the roofline time the planner charges it
(``stpc.cli.calibrate_ops``).

``batch_reread_bw`` (``DeviceSpec.batch_reread_bw``; optional, older profiles lack it and
charge none) is how fast a GEMM batched over one shared weight reads that weight again for
each element past the first, from the ``batched_gemm`` probe kept beside it (its shape and
its two timings: the batched block into a strided slice, as a ring step runs it, and the
same rows as one 2-D GEMM), and ``batch_reread_cached_bytes`` (optional, 0 where absent) how
much of such a weight the cache serves for free, from the same probe at a second, smaller
weight (``batched_gemm["small"]``). ``python -m stpc calibrate --amend PROFILE`` measures
both into a profile written before the probe had its present form, and notes so under
``amended``.

``fresh_alloc_bytes`` and ``fresh_page_bw`` (``DeviceSpec``; optional, older profiles lack
them and charge none): the size from which the allocator maps every block fresh, and how
fast such fresh memory is first touched beyond the write, from the ``fresh_alloc`` probe
kept beside them (a clone that size against a copy into a warm buffer, per round). ``python
-m stpc calibrate --amend PROFILE --probe fresh_alloc`` measures them into an older profile.

``overlap`` (written by ``calibrate`` since it measures it; older profiles lack it and get
the presets' figures): ``slowdown`` is how much of an asynchronous collective's time
compute running beside it loses (``cost_models.overlap``: a parameter's gradient bucket or
gather), ``ring_slowdown`` the same beside a ring step's P2P, ``grid_slowdown`` beside a
P(2^k x 2^k) op's steps, from the ``grid`` probe kept beside it (its forward + backward
against its GEMMs and transfers alone; profiles measured on ranks that form no grid, or
before it was measured, lack it: ``ring_slowdown``), ``ring_step_overhead_s`` one
ring step's time beyond its GEMM and its P2P, and ``collective_sync_s`` what a blocking
collective after a stretch of compute costs beyond its isolated time (the ranks' skew;
profiles written before it was measured lack it: 0), ``ring_sync_s`` the same right after
a ring (profiles written before it was measured lack it: ``collective_sync_s``).
Profiles written before ``ring_slowdown`` was measured apart have the ring's figure under
``slowdown``; they keep it for both.

Why bands: a real transport is not one straight alpha-beta line over three decades of
message size (NCCL switches protocols; gloo over loopback TCP gets markedly slower per
byte once messages spill out of the CPU caches). Besides the single least-squares
line per collective, a profile therefore keeps a *piecewise* alpha-beta model: one
line per pair of adjacent calibrated sizes, fitted to the nearest sizes (see
:func:`fit_bands`). The cost model uses the band containing the message size (the
first/last band extrapolates).

``group_collectives`` holds the same fits for each smaller group size a mesh axis can have,
timed with every group of that many consecutive ranks running at once (profiles written
before they were measured lack them; the cost model then uses the world's fits at every
group size, the ring formula scaling them).

``nbytes`` of a sample follows :class:`~stpc.cost_models.comm.CostModel`: the FULL
tensor for collectives, the per-rank message for p2p.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

import numpy as np

from .cluster import CLUSTERS, RING_STEP_OVERHEAD_S, Cluster, Link
from .devices import DeviceSpec, get_device

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


def coefficients(kind: str, n: int, nbytes: float) -> tuple[float, float]:
    """(c_alpha, c_beta) with time = c_alpha*alpha + c_beta*beta for a ring ``kind`` over
    ``n`` ranks, ``nbytes`` as in :mod:`comm`."""
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1.0, (n - 1.0) / n * nbytes
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes
    if kind == "all_to_all":
        return n - 1.0, (n - 1.0) / n * nbytes / n
    if kind == "p2p":
        return 1.0, float(nbytes)
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")


def fit_alpha_beta(samples: list[tuple[str, float, float]], n: int) -> tuple[float, float, float]:
    """Fit one link to ``samples`` of (kind, nbytes, seconds) measured on ``n`` ranks.

    Minimises the *relative* error (each row divided by its time) because sizes span
    orders of magnitude and the planner cares about ratios; alpha and beta are kept
    non-negative. Returns (alpha_s, bw_bytes_per_s, rms relative error)."""
    if len(samples) < 2:
        raise ValueError("need at least two (kind, nbytes, seconds) samples to fit alpha and beta")
    A = np.array([coefficients(kd, n, nb) for kd, nb, _ in samples], dtype=float)
    t = np.array([sec for _, _, sec in samples], dtype=float)
    if np.any(t <= 0):
        raise ValueError("measured times must be positive")
    Aw, tw = A / t[:, None], np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(Aw, tw, rcond=None)
    if alpha < 0:  # latency below resolution: bandwidth-only fit
        alpha = 0.0
        beta = float(Aw[:, 1] @ tw / (Aw[:, 1] @ Aw[:, 1]))
    if beta <= 0:  # sizes too small to see bandwidth: latency-only fit, a huge bandwidth
        beta = 1e-15
        alpha = float(Aw[:, 0] @ tw / (Aw[:, 0] @ Aw[:, 0]))
    pred = A @ np.array([alpha, beta])
    rel_rms = float(np.sqrt(np.mean((pred / t - 1.0) ** 2)))
    return float(alpha), float(1.0 / beta), rel_rms


def fit_bands(samples: list[tuple[str, float, float]], n: int) -> list[list[float]]:
    """Piecewise alpha-beta for one collective kind: for each pair of adjacent message
    sizes, a line fitted by least squares (relative error) to the two sizes bounding the
    band and their nearest neighbour on each side (up to four points). The neighbours
    keep one noisy sample from bending a band; the locality lets the lines follow a
    transport whose cost per byte changes with size. Returns ``[[upper_nbytes, alpha_s,
    bw_bytes_per_s], ...]`` sorted by size.

    A band's alpha is the intercept of a local line and may be negative (a steeper line
    at large sizes); it is only used inside and next to its band. A band whose local
    fit has no positive slope (noise) falls back to the least-squares line of all
    sizes."""
    kinds = {kd for kd, _, _ in samples}
    if len(kinds) != 1:
        raise ValueError(f"fit_bands takes samples of one collective kind, got {sorted(kinds)}")
    pts = sorted((nb, t) for _, nb, t in samples)
    if len(pts) < 2:
        raise ValueError("need at least two message sizes to fit bands")
    kind = samples[0][0]
    g_alpha, g_bw, _ = fit_alpha_beta(samples, n)
    bands = []
    for i in range(len(pts) - 1):
        local = pts[max(0, i - 1): i + 3]
        A = np.array([coefficients(kind, n, nb) for nb, _ in local], dtype=float)
        t = np.array([sec for _, sec in local], dtype=float)
        (alpha, beta), *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)
        if beta <= 0:
            alpha, beta = g_alpha, 1.0 / g_bw
        bands.append([float(pts[i + 1][0]), float(alpha), float(1.0 / beta)])
    return bands


def fit_gemm_curve(rows: list[dict]) -> tuple[float, float]:
    """(large-GEMM FLOP/s, ramp seconds) of one dtype's timed GEMMs (``{"m","n","k","seconds"}``):
    the line ``seconds = ramp + flops / rate`` (``DeviceSpec.gemm_ramp_s``'s curve) fitted by
    least squares on relative residuals, so the small GEMMs that show the ramp weigh as much
    as the large ones that show the rate. A negative intercept (timing noise on a flat curve)
    is no ramp: the line through the origin then, which is the FLOP-weighted mean rate."""
    f = np.array([2.0 * r["m"] * r["n"] * r["k"] for r in rows])
    t = np.array([float(r["seconds"]) for r in rows])
    if len(rows) >= 2 and np.ptp(f) > 0:
        slope, ramp = np.polyfit(f, t, 1, w=1.0 / t)   # relative residuals: small GEMMs count too
        if ramp >= 0 and slope > 0:
            return float(1.0 / slope), float(ramp)
    return float(f.sum() / t.sum()), 0.0


def predict(kind: str, n: int, nbytes: float, alpha_s: float, bw_bytes_per_s: float) -> float:
    """Seconds the fitted model gives for one ``kind`` of ``nbytes`` on ``n`` ranks."""
    ca, cb = coefficients(kind, n, nbytes)
    return ca * alpha_s + cb / bw_bytes_per_s


def save_profile(profile: dict, path: str) -> None:
    _validate(profile, path)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(profile, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)  # never leave a half-written profile behind


def _validate(p: dict, path: str) -> None:
    for key in ("version", "name", "ranks", "device", "link", "collectives"):
        if key not in p:
            raise ValueError(f"profile {path}: missing key {key!r} (re-run `python -m stpc calibrate`)")
    if p["version"] != 1:
        raise ValueError(f"profile {path}: unsupported version {p['version']}")


def read_profile(path: str) -> dict:
    """The profile JSON at ``path``, checked (a clear error where it is missing or not one)."""
    try:
        with open(path) as fh:
            p = json.load(fh)
    except FileNotFoundError:
        raise FileNotFoundError(f"no calibration profile at {path}; create one with "
                                f"`python -m stpc calibrate --out {path}`") from None
    _validate(p, path)
    return p


def device_spec(d: dict) -> DeviceSpec:
    """A profile's ``device`` entry as a :class:`DeviceSpec` (the figures it lacks take their
    defaults: a profile written before a probe charges nothing for it)."""
    return DeviceSpec(d["name"], dict(d["peak_flops"]), mem_bw=float(d["mem_bw"]),
                      mem_bytes=float(d["mem_bytes"]), efficiency=float(d.get("efficiency", 1.0)),
                      gemm_ramp_s=float(d.get("gemm_ramp_s", 0.0)),
                      gemm_ramps={k: float(v) for k, v in d.get("gemm_ramps", {}).items()},
                      op_slowdown={k: float(v) for k, v in d.get("op_slowdown", {}).items()},
                      # (profiles written before the batched-block probe lack it: no extra cost)
                      batch_reread_bw=float(d["batch_reread_bw"]) if d.get("batch_reread_bw") else None,
                      batch_reread_cached_bytes=float(d.get("batch_reread_cached_bytes") or 0.0),
                      # (profiles written before the fresh-allocation probe lack both: no extra cost)
                      fresh_alloc_bytes=float(d["fresh_alloc_bytes"]) if d.get("fresh_alloc_bytes") else None,
                      fresh_page_bw=float(d["fresh_page_bw"]) if d.get("fresh_page_bw") else None)


def load_profile(path: str) -> Cluster:
    """A calibration profile as a :class:`Cluster`: one node of ``ranks`` devices, the
    measured device throughput (``efficiency=1``), the jointly fitted link as both intra
    and inter link, and per-collective fits in ``collective_links``."""
    p = read_profile(path)
    device = device_spec(p["device"])
    link = Link(float(p["link"]["alpha_s"]), float(p["link"]["bw_bytes_per_s"]))
    per_kind = {kind: Link(float(c["alpha_s"]), float(c["bw_bytes_per_s"]))
                for kind, c in p["collectives"].items()}
    bands = {kind: _bands(c) for kind, c in p["collectives"].items() if c.get("bands")}
    bands.update({(kind, int(n)): _bands(c) for n, kinds in p.get("group_collectives", {}).items()
                  for kind, c in kinds.items() if c.get("bands")})
    overlap = p.get("overlap", {})  # (profiles written before the overlap was measured lack it)
    if "ring_step_overhead_s" in overlap and "ring_ranks" not in overlap:
        warnings.warn(f"{path}: its ring figures (overlap.ring_slowdown, ring_step_overhead_s) were fitted before "
                      f"a ring was costed as its op runs it (n blocks, n - 1 of them moved: CostModel.ring), so "
                      f"they charge a ring's transfers too little. Fix: python -m stpc calibrate --amend {path} "
                      f"--probe overlap", UserWarning, stacklevel=2)
    if "collective_sync_s" in overlap and overlap.get("blocking", {}).get("reference") != "typical rank":
        warnings.warn(f"{path}: its blocking collective's synchronisation (overlap.collective_sync_s) was measured "
                      f"against the slowest rank's compute, not the typical rank's the planner charges, so it leaves "
                      f"out a rank that runs slower all along. Fix: python -m stpc calibrate --amend {path} "
                      f"--probe overlap", UserWarning, stacklevel=2)
    return Cluster(p["name"], device, nodes=1, devices_per_node=int(p["ranks"]), intra=link,
                   inter=link, collective_links=per_kind, collective_bands=bands,
                   overlap_slowdown=overlap.get("slowdown"),
                   ring_step_overhead_s=float(overlap.get("ring_step_overhead_s", RING_STEP_OVERHEAD_S)),
                   # (profiles written before the two were told apart measured one slowdown, on a ring)
                   ring_overlap_slowdown=overlap.get("ring_slowdown", overlap.get("slowdown")),
                   grid_overlap_slowdown=overlap.get("grid_slowdown"),  # (None before the grid was probed apart)
                   collective_sync_s=float(overlap.get("collective_sync_s", 0.0)),
                   ring_sync_s=float(overlap["ring_sync_s"]) if "ring_sync_s" in overlap else None,
                   # (the typical rank's compute before the blocking probe's collective)
                   collective_sync_compute_s=(float(overlap["blocking"]["gemms_typical_s"])
                                              if "gemms_typical_s" in overlap.get("blocking", {}) else None),
                   gather_staging=int(p.get("gather_staging", 1)))  # (calibrate runs gloo ranks)


def _bands(entry: dict) -> tuple:
    return tuple((float(u), float(a), float(bw)) for u, a, bw in entry["bands"])


def get_cluster(name_or_profile_path: str) -> Cluster:
    """A preset by name (``cluster.CLUSTERS``), or a calibration profile (a ``.json`` path
    written by ``python -m stpc calibrate``)."""
    if name_or_profile_path in CLUSTERS:
        return CLUSTERS[name_or_profile_path]
    if name_or_profile_path.endswith(".json") or os.path.exists(name_or_profile_path):
        return load_profile(name_or_profile_path)
    raise KeyError(f"unknown cluster {name_or_profile_path!r}: not a preset "
                   f"({', '.join(CLUSTERS)}) nor a profile .json path")


def default_profile_path() -> str:
    """Where this machine's calibration profile is looked for: ``$STPC_PROFILE``, else
    ``$XDG_CACHE_HOME/stpc/profile.json`` (``~/.cache/stpc/profile.json``)."""
    if os.environ.get("STPC_PROFILE"):
        return os.environ["STPC_PROFILE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "stpc", "profile.json")


# A GPU's name (torch.cuda.get_device_name) -> the preset whose links a node of it has.
_GPU_NODES = (("H200", "H200", "dgx-h100"), ("H100", "H100-SXM", "dgx-h100"), ("A100", "A100-80GB", "dgx-h100"),
              ("V100", "V100-32GB", "primepar-v100"))


def world_cluster(world_size: int, device_type: str, device_name: str = "", local_size: int | None = None,
                  profile_path: str | None = None) -> Cluster:
    """The cluster a job of ``world_size`` ranks on ``device_type`` runs on, when the user
    names none: this machine's calibration profile if there is one for this device type
    (:func:`default_profile_path`), resized to the world; on the CPU ``cpu-local`` with
    ``world_size`` ranks; on CUDA the preset node of the GPU named ``device_name`` (its
    device spec, the preset's links) with ``local_size`` GPUs a node."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    path = profile_path or default_profile_path()
    if os.path.exists(path):
        prof = load_profile(path)
        with open(path) as fh:
            backend = json.load(fh).get("backend", "gloo")
        if (backend == "nccl") == (device_type == "cuda"):
            return dataclasses.replace(prof, nodes=1, devices_per_node=world_size)
    if device_type != "cuda":
        base = CLUSTERS["cpu-local"]
        return dataclasses.replace(base, name=f"cpu-local-{world_size}", nodes=1, devices_per_node=world_size)
    local = max(1, min(local_size or world_size, world_size))
    for key, spec, preset in _GPU_NODES:
        if key.lower() in device_name.lower():
            base = CLUSTERS[preset]
            return dataclasses.replace(base, name=f"{preset}-{world_size}", device=get_device(spec),
                                       nodes=math.ceil(world_size / local), devices_per_node=local)
    raise ValueError(f"no cost model for the GPU {device_name!r}; pass cluster= a preset "
                     f"({', '.join(CLUSTERS)}) or a profile written by `python -m stpc calibrate`")
