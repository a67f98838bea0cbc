"""cache: plans kept on disk, so a relaunch with the same model, mesh and inputs skips the search.

A plan is stored under a key that hashes everything the search reads: the traced graph
(its code and every placeholder's shape and dtype), the mesh, the cluster (a preset's
name, a profile file's content, a Cluster's fields), the budget, the hints, the temporal switch, the dtype
and optimizer layout, and the code that plans (stpc's version and a digest of its
frontend, planner and cost-model sources, so an edited planner never reads a stale
plan). Hints with Python predicates cannot be hashed faithfully: such searches are
not cached.

Files are JSON (``Plan.to_json``, never pickle), written to a temporary file in the same
folder and renamed over the target (atomic on POSIX): two ranks writing the same plan
at once leave one whole file. A file that does not parse, is not a JSON object, has no
``plan_hash`` or whose content does not match it is reported with a warning, ignored and
rewritten.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
import warnings
from functools import lru_cache

import torch

from stpc.cost_models import GRAD_BUCKET_BYTES
from stpc.planner.hints import Hints
from stpc.planner.plan import Plan

__all__ = ["PlanCache", "default_dir", "plan_key", "graph_digest", "CacheWarning"]

_ROOT = pathlib.Path(__file__).resolve().parents[1]


class CacheWarning(UserWarning):
    """A cached plan file was unreadable and is being replaced."""


def default_dir() -> pathlib.Path:
    """``$STPC_PLAN_CACHE``, else ``$XDG_CACHE_HOME/stpc/plans`` (``~/.cache/stpc/plans``)."""
    if os.environ.get("STPC_PLAN_CACHE"):
        return pathlib.Path(os.environ["STPC_PLAN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "stpc" / "plans"


@lru_cache(maxsize=1)
def _code_digest() -> str:
    """stpc's version and the sources that decide a plan."""
    try:
        version = importlib.metadata.version("stpc")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        version = "unknown"
    h = hashlib.sha256(version.encode())
    folders = [_ROOT / "frontend", _ROOT / "planner", _ROOT.parent / "cost_models", _ROOT / "placement.py"]
    for folder in folders:
        files = [folder] if folder.is_file() else sorted(folder.rglob("*.py"))
        for f in files:
            h.update(str(f.relative_to(_ROOT.parent)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def graph_digest(tg) -> str:
    """The traced program: its code, every placeholder's shape and dtype, its tied parameters."""
    h = hashlib.sha256(tg.gm.code.encode())
    for n in tg.gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            h.update(f"{n.name}:{tuple(v.shape) if isinstance(v, torch.Tensor) else repr(v)}:"
                     f"{getattr(v, 'dtype', '')}".encode())
    h.update(json.dumps(sorted(tg.tied_params.items())).encode())
    return h.hexdigest()


def _cluster_key(cluster) -> str:
    if isinstance(cluster, str):
        if os.path.exists(cluster):
            return "profile:" + hashlib.sha256(pathlib.Path(cluster).read_bytes()).hexdigest()
        return "preset:" + cluster
    return "cluster:" + hashlib.sha256(repr(cluster).encode()).hexdigest()  # a frozen dataclass: all its fields


def _hints_key(hints) -> str | None:
    if hints is None or isinstance(hints, str):
        return repr(hints)
    if isinstance(hints, Hints):
        if hints.force or hints.param_force:
            return None  # Python predicates: not hashable faithfully
        return json.dumps({"exact": sorted((k, list(v)) for k, v in hints.param_exact.items()),
                           "inputs": sorted((k, list(v)) for k, v in hints.input_exact.items()),
                           "temporal": hints.temporal, "name": hints.name,
                           "keep_gathered": list(hints.keep_gathered), "sequence_parallel": hints.sequence_parallel,
                           **({"recompute": hints.recompute} if hints.recompute is not None else {}),
                           **({"recompute_layers": hints.recompute_layers}
                              if hints.recompute_layers is not None else {})})
    return None


def plan_key(tg, mesh, cluster, budget_bytes, hints, temporal, dtype="fp32",
             optimizer_layout="fp32-adam", optimizer_impl="foreach",
             grad_bucket_bytes: float | None = GRAD_BUCKET_BYTES) -> str | None:
    """The cache key of a search, or None when the search cannot be cached faithfully."""
    ck, hk = _cluster_key(cluster), _hints_key(hints)
    if hk is None:
        return None
    key = {"graph": graph_digest(tg), "mesh": repr(mesh), "cluster": ck,
           "budget": budget_bytes, "hints": hk, "temporal": bool(temporal), "dtype": dtype,
           "optimizer": optimizer_layout, "optimizer_impl": optimizer_impl, "code": _code_digest()}
    if grad_bucket_bytes != GRAD_BUCKET_BYTES:  # (the default's keys as they were)
        key["grad_bucket_bytes"] = grad_bucket_bytes
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class PlanCache:
    """Plans on disk under ``directory`` (default :func:`default_dir`), one JSON file a key."""

    def __init__(self, directory=None):
        self.dir = pathlib.Path(directory) if directory is not None else default_dir()

    def path(self, key: str) -> pathlib.Path:
        return self.dir / f"{key}.json"

    def get(self, key: str) -> Plan | None:
        p = self.path(key)
        try:
            text = p.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"stpc: cannot read cached plan {p} ({e}); planning again", CacheWarning, stacklevel=2)
            return None
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise ValueError(f"holds a JSON {type(d).__name__}, not a plan")
            if not isinstance(d.get("plan_hash"), str):
                raise ValueError("has no plan_hash to verify its content by")
            return Plan.from_json(text)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # truncated, corrupted, of another format
            warnings.warn(f"stpc: cached plan {p} is corrupt ({type(e).__name__}: {str(e)[:120]}); "
                          f"ignoring it, it will be rewritten", CacheWarning, stacklevel=2)
            return None

    def put(self, key: str, plan: Plan) -> pathlib.Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.path(key)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(plan.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return target
