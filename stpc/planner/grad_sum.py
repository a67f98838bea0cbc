"""grad_sum: a parameter read by several ops has its gradient summed once per mesh axis.

A parameter replicated over a mesh axis, read by an op that splits its work there, gets a
partial gradient from that reader, summed over the axis in backward (Megatron's "f":
``costs.axis_reshard_phases``, with its bucket copy ``costs.param_copy_phases``). Where
several ops read one parameter (a GPT's embedding and its tied LM head) the runtime sums
once per axis, not once per reader: ``cleanup`` merges their identical ``f``s into one,
whose backward reduces the readers' summed gradient, and ``defer_grad_sync`` hands a
parameter every reader of which splits to the bucketed reducer, which reduces it once.
Either way the one reduction starts when backward has passed the earliest reader in
forward that needs it, so it overlaps that reader's backward.

The same holds on an axis the parameter is stored split over (ZeRO/FSDP) and read whole
by work split there: each reader's reshard is the same ``all_gather`` of the parameter
(``grad="rs"``), which ``cleanup`` merges into one read by all of them: one gather in
forward (issued before the earliest reader, ``prefetch_params``), one re-gather in
backward if a reader keeps the weight for backward (none where a head op reads it: the
head's gathers are kept from forward, a tied embedding's too, as FSDP2's root module keeps
them), and one reduce-scatter of the readers' summed gradient: what the earliest reader's
edge charges (its re-gather: whether any reader outside the head keeps the weight). (The
merged gather's output lives from the earliest reader to the last in forward, for the
embedding and the head the whole forward, and on to the head's backward. No memory edge is
added for it: the memory model charges the head's whole copy as where the head gathers it
alone, a named simplification, README's limitations.)

Each reader's edge charged as it stands would pay it once per reader. The right charge,
"once per axis if any reader needs it, hidden behind the earliest such reader", couples the
parameter's placement with every reader's strategy: not a pairwise term. It becomes one by
giving the parameter's solver group a *mode* per mesh axis beside its placement:

* ``PER_USE`` (-1): every reader pays its edge as it stands (never less than the truth);
* ``j >= 0``: reader j (forward order) is the earliest that needs the sum. It pays its
  edge as it stands, and must need it; a reader before it must not need it; a reader
  after it pays nothing for the sum (its gradient rides in reader j's reduction).

A mode whose condition fails pays ``penalty``, at least what any one reader's sum costs,
so no mode is ever cheaper than the truth, and for every choice of the readers one mode
(the earliest reader that needs it, or ``PER_USE`` if none does) charges exactly it: the
minimum over modes is exact. An axis the placement replicates gets modes; one it splits
gets them only where the readers' gathers are the same call (``modes``' ``gathers``):
every reader reads one node (not views or casts of their own) and the placement splits
no other axis (a gather over one axis of several reads the last one's output, which
differs between readers that gather different sets of axes).

Named simplification: where the sum is kept in the graph (a reader that reads the
parameter whole, without splitting, keeps the others' ``f``), ``cleanup`` merges only
``f``s of identical calls; two readers splitting over different sets of axes of a
multi-axis mesh may each keep their own on an axis, one reduction each at run time, charged
once here.
"""
from __future__ import annotations

import itertools

from stpc.placement import REPLICATE

PER_USE = -1
MAX_EARLIEST = 3  # readers that may be named the earliest to need the sum (per axis)

# a reader's role on one axis under a mode (``role``)
AS_IS, BEFORE, EARLIEST, AFTER = 0, 1, 2, 3


def modes(placement: tuple, mesh: tuple, readers: int, gathers: bool = False) -> list[tuple[int, ...]]:
    """Every mode of a parameter of ``placement`` read by ``readers`` ops: per mesh axis
    ``PER_USE``, or (an axis of more than one device that it replicates, or, with
    ``gathers`` (every reader reads one node), that it splits alone on a dim, ZeRO) the
    reader that is the earliest to need the sum (or gather): any but the last (the last as
    earliest charges what ``PER_USE`` does), and one of the first ``MAX_EARLIEST`` (the
    modes multiply over the axes; a sum whose earliest reader is later is charged per
    reader, an upper bound)."""
    split = [a for a, (tok, n) in enumerate(zip(placement, mesh)) if tok != REPLICATE and n > 1]
    alone = gathers and len(split) == 1 and placement[split[0]][0] == "S"
    per_axis = [[PER_USE] + (list(range(min(readers - 1, MAX_EARLIEST)))
                             if n > 1 and (tok == REPLICATE or alone and a == split[0]) else [])
                for a, (tok, n) in enumerate(zip(placement, mesh))]
    return list(itertools.product(*per_axis))


def role(mode: int, reader: int) -> int:
    """Reader ``reader``'s role on an axis whose mode is ``mode``."""
    if mode == PER_USE:
        return AS_IS
    return BEFORE if reader < mode else EARLIEST if reader == mode else AFTER


def needs_sum(tok: str, q: str, split: bool, needs_grad: bool) -> bool:
    """A reader's synchronisation on the axis is the one its parameter's readers share: the
    parameter read whole (``q``) by work split there, its gradient summed over the axis
    (``costs.axis_reshard_phases``' all-reduce where it is replicated there; where it is
    stored split, ``tok``, the gather whose dual reduce-scatters it)."""
    return needs_grad and split and q == REPLICATE and (tok == REPLICATE or tok[0] == "S")


def charge(base: float, role_: int, needs: bool, penalty: float) -> float:
    """A reader's edge on one axis under its role: ``base`` as it stands."""
    if role_ == BEFORE and needs or role_ == EARLIEST and not needs:
        return base + penalty
    if role_ == AFTER and needs:
        return 0.0
    return base


def penalty(sum_s: float, copy_s: float, overlap_slowdown: float) -> float:
    """More than any reader pays for the sum (``sum_s`` its collectives, ``copy_s`` its
    copies: the bucket's, or a gather's cuts): the exposed part of an overlapped collective
    is at most ``max(1, slowdown)`` times it (``overlap.exposed``)."""
    return 2.0 * (max(1.0, overlap_slowdown) * sum_s + copy_s) + 1e-6


__all__ = ["AFTER", "AS_IS", "BEFORE", "EARLIEST", "MAX_EARLIEST", "PER_USE", "charge", "modes", "needs_sum", "penalty", "role"]
