"""A long benchmark's finished jobs on disk, so a run that is stopped loses only the jobs
in flight (``python -m stpc bench primepar --checkpoint FILE``).

One JSON line per finished job, appended (and flushed to disk) as the job finishes: its
key (everything the job's result depends on: the model, the cluster, the sizes, the batch,
the budget...), its result, the seconds it took, and the code that planned it
(:func:`code_version`). A later run given the same file takes every job whose key it finds
there instead of planning it again, and appends the rest. A line cut short by a killed
process is skipped. Results planned by other code than the running one are still taken
(a planner change does not void hours of planning); the report names every code version
its jobs came from, so a mixed run says so.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def code_version() -> str:
    """The stpc checkout's commit (``git describe --always --dirty``), or "unknown" outside
    a git checkout."""
    try:
        out = subprocess.run(["git", "-C", _ROOT, "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


class Checkpoint:
    """The finished jobs of ``path`` (none if it does not exist yet), by key; ``put``
    appends one. ``path=None``: nothing read or written, every job planned."""

    def __init__(self, path: str | None):
        self.path = path
        self.records: dict[str, dict] = {}
        self.taken: list[dict] = []     # the records this run took instead of planning
        self.planned: list[dict] = []   # the records of the jobs this run planned
        if path and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue    # the last line of a killed run, cut short
                    self.records[key_text(rec["key"])] = rec

    def get(self, key: dict):
        """The result recorded for ``key``, or None (noted as taken when found)."""
        rec = self.records.get(key_text(key))
        if rec is None:
            return None
        self.taken.append(rec)
        return rec["result"]

    def provenance(self) -> dict:
        """Where this run's results came from: the jobs per code version, and the jobs taken
        from the file with the seconds their planning took."""
        codes: dict[str, int] = {}
        for rec in self.taken + self.planned:
            codes[rec["code"]] = codes.get(rec["code"], 0) + 1
        return {"path": self.path, "codes": codes, "taken": len(self.taken),
                "taken_wall_s": sum(r["wall_s"] for r in self.taken), "planned": len(self.planned)}

    def put(self, key: dict, result, wall_s: float, code: str) -> None:
        rec = {"key": key, "result": result, "wall_s": wall_s, "code": code,
               "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self.records[key_text(key)] = rec
        self.planned.append(rec)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell():
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")   # end a line a killed run cut short, so it does not swallow this one
                f.write((json.dumps(rec) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())


__all__ = ["Checkpoint", "code_version", "key_text"]
