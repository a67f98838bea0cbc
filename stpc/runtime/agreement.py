"""agreement: before any step runs, every rank checks that it holds what rank 0 holds.

* the same traced program: rank 0 plans for everyone (:func:`from_rank0`), so a rank that
  traced another program (other example input shapes) would run a plan made for rank 0's;
* the same plan: a rank with a different plan would issue a different sequence of
  collectives and P2P transfers, a hang or a silent wrong answer. The check takes the
  plan's hash (a string), not the plan: the runtime knows nothing of plans;
* the same full weights: each rank cuts its shards from its own copy of the model, so
  a rank initialised differently (an unseeded init) would train a model nobody built;
* the communication each rank will issue: every rank derives, from its own program, the
  sequence of collectives and transfers each rank will issue; a rank whose own sequence
  is not the one the others expect of it would hang or corrupt data at the first step.

The checks' tensors live where the group's collectives take them (:func:`_comm_device`):
the CPU under gloo or a mixed ``"cpu:gloo,cuda:nccl"`` world, this rank's current CUDA
device under NCCL alone (which moves no CPU tensors).
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["check_plan_agreement", "PlanMismatch", "check_tensors_agree", "TensorMismatch",
           "check_schedule_agreement", "ScheduleMismatch", "check_traced_agreement", "TraceMismatch", "from_rank0"]


def _comm_device(group=None) -> torch.device:
    """The device ``group``'s (default WORLD) collectives take their tensors on: the one
    torch's own object collectives use (the CPU when the group has a CPU backend; else its
    backend's device, e.g. CUDA under NCCL alone), this rank's current device of that type."""
    kind = distributed_c10d._get_object_coll_device(group)
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    return torch.device(kind, module.current_device()) if hasattr(module, "current_device") else torch.device(kind)


def _all_gather(mine: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``mine`` (same shape and dtype everywhere), gathered on the group's
    device and returned on the CPU."""
    device = _comm_device(group)
    mine = mine.to(device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, mine, group=group)
    return [t.cpu() for t in got]


class TraceMismatch(RuntimeError):
    """Ranks traced different programs from their models and example inputs."""


def check_traced_agreement(digest: str, group=None) -> None:
    """All-gather each rank's digest of its traced program (graph, input shapes, mesh) over
    ``group`` (default WORLD) and raise :class:`TraceMismatch` on every rank, naming the ranks
    whose digest differs from rank 0's."""
    mine = torch.tensor(list(hashlib.sha256(digest.encode()).digest()), dtype=torch.uint8)
    got = _all_gather(mine, group)
    bad = [r for r in range(len(got)) if not torch.equal(got[r], got[0])]
    if bad:
        raise TraceMismatch(
            f"ranks {bad} traced another program than rank 0 (other example input shapes or dtypes, "
            f"another model, or another mesh). Fix: call stpc.compile with the same model and example "
            f"inputs of the same shapes on every rank.")


def _portable(e: BaseException) -> BaseException:
    """``e`` as it can cross to another process: itself where it pickles back to its own
    type, else a RuntimeError carrying its type and message."""
    try:
        back = pickle.loads(pickle.dumps(e))
        if type(back) is type(e) and str(back) == str(e):
            return back
    except Exception:  # (an exception whose __init__ takes other arguments than its args)
        pass
    return RuntimeError(f"{type(e).__name__} on rank 0: {e}")


def from_rank0(make: Callable[[], object]):
    """``make()`` run on rank 0 alone, its result (picklable) returned on every rank of the
    world, with one broadcast. An exception ``make`` raises is raised on every rank (rank
    0's own; on the others a copy, :func:`_portable`), so no rank waits for a value that is
    not coming."""
    if dist.get_world_size() == 1:
        return make()
    box, error = [None], None
    if dist.get_rank() == 0:
        try:
            box[0] = (True, make())
        except Exception as e:
            box[0], error = (False, _portable(e)), e
    dist.broadcast_object_list(box, src=0, device=_comm_device())
    if error is not None:
        raise error
    ok, value = box[0]
    if not ok:
        raise value
    return value


class PlanMismatch(RuntimeError):
    """Ranks hold different plans: running would hang or compute garbage."""


def _all_equal(word: int, group=None) -> bool:
    """Whether every rank of ``group`` holds the same ``word`` (0 <= word < 2**62): one
    all-reduce of two integers, the largest word and the largest negated one, so every rank
    reads the same verdict. Two elements, not an all-gather of the digests, because the
    compiled model runs this check on every call and gloo's small collectives cost by their
    element count against the ranks' (``benchmarks/agreement_check.py``; on 4 ranks of the
    2-core development VM this check took 2.1 ms against the all-gather's 4.5, on 8 ranks 7.3
    against 15.0, on 2 a tie)."""
    t = torch.tensor([word, -word], dtype=torch.int64, device=_comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    high, low = t.tolist()
    return high == -low


def check_plan_agreement(plan_hash: str, group=None) -> None:
    """Raise :class:`PlanMismatch` on every rank of ``group`` (default WORLD), naming the
    ranks whose plan hash differs from rank 0's, unless every rank holds the same hash. The
    common case, agreement, costs one small all-reduce (:func:`_all_equal`, on 62 bits of the
    hash); only where that finds a difference are the whole hashes all-gathered to name the
    ranks (every rank reads the same verdict, so all of them gather)."""
    try:
        digest = bytes.fromhex(plan_hash)[:32]
    except ValueError:
        digest = b""
    if len(digest) != 32:  # not a Plan.hash(): hash it to a fixed width
        digest = hashlib.sha256(plan_hash.encode()).digest()
    if _all_equal(int.from_bytes(digest[:8], "little") >> 2, group):
        return
    got = _all_gather(torch.tensor(list(digest), dtype=torch.uint8), group)
    n = len(got)
    hashes = [bytes(t.tolist()).hex()[:12] for t in got]
    bad = [r for r in range(n) if hashes[r] != hashes[0]]
    if bad:
        raise PlanMismatch(
            f"ranks disagree on the plan: rank 0 has plan {hashes[0]}, ranks {bad} have "
            f"{[hashes[r] for r in bad]}. Fix: plan once and pass the same Plan (e.g. Plan.load) "
            f"to stpc.compile on every rank.")


class TensorMismatch(RuntimeError):
    """Ranks hold different values for tensors that must be equal everywhere."""


def _digest_bytes(raw: bytes) -> int:
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little", signed=True)


def _digest(t: torch.Tensor) -> int:
    return _digest_bytes(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def check_tensors_agree(named: dict, group=None, what: str = "tensors") -> None:
    """Raise :class:`TensorMismatch` on every rank, naming the tensors and ranks, unless every
    rank of ``group`` (default WORLD) holds bit-identical ``named`` tensors (same names in
    the same order on every rank). Tensors on ``meta`` hold no values and are skipped."""
    names = [k for k, t in named.items() if t.device.type != "meta"]
    n = dist.get_world_size(group)
    # first the names, in a fixed-size message: tables of different lengths must not meet
    # in one all_gather (that could hang or fail obscurely)
    head = torch.tensor([len(names), _digest_bytes("\n".join(names).encode())], dtype=torch.int64)
    heads = _all_gather(head, group)
    differ = [r for r in range(n) if not torch.equal(heads[r], heads[0])]
    if differ:
        raise TensorMismatch(f"ranks {differ} hold a different set of {what} than rank 0 ({len(names)} here). "
                             f"Fix: build the same model on every rank before stpc.compile.")
    got = _all_gather(torch.tensor([_digest(named[k]) for k in names], dtype=torch.int64), group)
    bad = {}
    for r in range(1, n):
        for i in torch.nonzero(got[r] != got[0]).flatten().tolist():
            bad.setdefault(names[i], []).append(r)
    if bad:
        shown = ", ".join(f"{k} (ranks {rs})" for k, rs in list(bad.items())[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise TensorMismatch(
            f"ranks hold different {what} than rank 0: {shown}{more}. Fix: build the model identically "
            f"on every rank (torch.manual_seed before building it) or load the same checkpoint on "
            f"every rank before stpc.compile.")


class ScheduleMismatch(RuntimeError):
    """A rank's program would issue other communication than the other ranks expect of it."""


def check_schedule_agreement(mine: str, expected: list[str], group=None) -> None:
    """All-gather every rank's digest of its own communication schedule (``mine``) and raise
    :class:`ScheduleMismatch` on every rank, naming the ranks, unless rank r's digest is
    ``expected[r]`` for every r (what this rank's program says each rank will issue)."""
    n = dist.get_world_size(group)
    if len(expected) != n:
        raise ValueError(f"{len(expected)} expected digests for {n} ranks")
    to_bytes = lambda h: torch.tensor(list(hashlib.sha256(h.encode()).digest()), dtype=torch.uint8)  # noqa: E731
    got = _all_gather(to_bytes(mine), group)
    bad = [r for r in range(n) if not torch.equal(got[r], to_bytes(expected[r]))]
    if bad:
        raise ScheduleMismatch(
            f"ranks {bad} would issue other collectives or P2P transfers than rank "
            f"{dist.get_rank()}'s program expects of them: running would hang or corrupt data. Fix: run the "
            f"same stpc and torch versions with the same plan and inputs on every rank")
