"""agreement: before any step runs, every rank checks that it holds the same plan as rank 0.

A rank with a different plan would issue a different sequence of collectives and
P2P transfers: a hang, or a silent wrong answer. The check takes the plan's hash
(a string), not the plan: the runtime knows nothing of plans.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

__all__ = ["check_plan_agreement", "PlanMismatch"]


class PlanMismatch(RuntimeError):
    """Ranks hold different plans: running would hang or compute garbage."""


def check_plan_agreement(plan_hash: str, group=None) -> None:
    """All-gather the plan hash over ``group`` (default WORLD) and raise :class:`PlanMismatch`
    naming the ranks whose hash differs from rank 0's, before any step runs."""
    try:
        digest = bytes.fromhex(plan_hash)[:32]
    except ValueError:
        digest = b""
    if len(digest) != 32:  # not a Plan.hash(): hash it to a fixed width
        digest = hashlib.sha256(plan_hash.encode()).digest()
    mine = torch.tensor(list(digest), dtype=torch.uint8)
    n = dist.get_world_size(group)
    got = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(got, mine, group=group)
    hashes = [bytes(t.tolist()).hex()[:12] for t in got]
    bad = [r for r in range(n) if hashes[r] != hashes[0]]
    if bad:
        raise PlanMismatch(
            f"ranks disagree on the plan: rank 0 has plan {hashes[0]}, ranks {bad} have "
            f"{[hashes[r] for r in bad]}. Fix: plan once and pass the same Plan (e.g. Plan.load) "
            f"to stpc.compile on every rank.")
