"""failure: a collective or P2P transfer that failed becomes an error that says where.

When a rank dies or stalls, its peers' next collective or transfer fails in the backend
(gloo: "Connection closed by peer" at once, or "Timed out waiting ...ms" after the process
group's timeout; NCCL: a watchdog or communicator error). :func:`comm_failure` turns that
into a :class:`CommFailure` naming the operation, forward or backward, the group and this
rank, and what to do, so every surviving rank stops with the same readable story instead
of hanging or printing a transport backtrace.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["CommFailure", "comm_failure", "stage"]


class CommFailure(RuntimeError):
    """A collective or P2P transfer failed: a peer rank died, stalled past the timeout, or
    issued a different sequence of communication."""


def stage() -> str:
    """``"backward"`` while autograd runs a backward pass, else ``"forward"``."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def comm_failure(what: str, group: str | None, err: BaseException) -> BaseException:
    """The error to raise for ``err`` (raised by ``what`` on ``group``): a :class:`CommFailure`
    when ``err`` is a backend failure, ``err`` itself otherwise."""
    if isinstance(err, CommFailure) or not isinstance(err, RuntimeError):
        return err
    text = str(err)
    backend = isinstance(err, getattr(dist, "DistBackendError", ())) or any(
        k in text for k in ("gloo", "Gloo", "NCCL", "Timed out", "Connection closed", "Connection reset",
                            "Broken pipe", "timed out"))
    if not backend:
        return err
    rank = dist.get_rank() if dist.is_initialized() else "?"
    cause = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    on = f" over group {group}" if group else ""
    return CommFailure(
        f"stpc: {stage()} {what}{on} failed on rank {rank}: a peer rank died, stalled past the process "
        f"group's timeout, or issued different communication ({cause}). Fix: look for the first error in the "
        f"other ranks' logs; if a rank was only slow, raise the timeout (stpc.compile(..., timeout_s=...))")
