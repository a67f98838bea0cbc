"""The spatial-temporal schedules, step by step: which block of I, W and O each device holds.

``O[M,K] = I[M,N] · W[N,K]`` (DESIGN.md, "The spatial-temporal primitives"), forward phase:

* AG-ring (P devices): I split on M, W on K; device i starts with I block i and passes it on;
* RS-ring (P devices): I and W split on the contraction N; device i computes one partial
  output block per step, adds the accumulator received from its neighbour and passes it on,
  ending with its own fully reduced block;
* P(2^k x 2^k) (4^k devices as a grid): I, W and O in a 2^k x 2^k block grid, Cannon's skewed
  layouts, I moving along grid rows and W along grid columns.

Nothing here restates a rule: the blocks are *simulated* from the runtime's own
(``stpc.runtime.ops.ring``): where each block starts (the P(2^k x 2^k) layout functions
``primepar_shard_input/_weight/_output`` applied to a grid of block numbers; device i's own
block for the rings, and its own output block at the end of an RS-ring) and where it moves
each step (``ring_peers``, ``primepar_peers``, the rules the ops and ``passes.verify`` use).
The tests hold the result against the formulas of the ring module's and DESIGN's text.
"""
from __future__ import annotations

import math
import textwrap

import torch
from matplotlib.colors import to_rgba
from matplotlib.patches import Rectangle

from stpc.runtime.ops.ring import (primepar_coords, primepar_peers, primepar_shard_input, primepar_shard_output,
                                   primepar_shard_weight, ring_peers)
from stpc.viz._figure import COLORS, new_figure, save

KINDS = {"ag_ring": "AG-ring", "rs_ring": "RS-ring", "p2x2": "P(2^k x 2^k)"}
DIMS = {"I": ("M", "N"), "W": ("N", "K"), "O": ("M", "K")}


def _kind(kind: str) -> str:
    k = kind.lower().replace("-", "_").replace(" ", "")
    k = {"ag": "ag_ring", "agring": "ag_ring", "rs": "rs_ring", "rsring": "rs_ring", "primepar": "p2x2",
         "p(2^kx2^k)": "p2x2", "p2^kx2^k": "p2x2"}.get(k, k)
    if k not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}: use one of {', '.join(KINDS)}")
    return k


def schedule_blocks(kind: str, devices: int = 4) -> dict:
    """The forward schedule of ``kind`` (``ag_ring``, ``rs_ring``, ``p2x2``) on ``devices``:
    ``{"kind", "devices", "grids": {"I"|"W"|"O": (row blocks, column blocks)}, "coords": a
    label per device, "steps": [[{"I": (row, col), "W": (row, col), "O": (row, col),
    "terms": contraction blocks summed into that O block so far, "of": how many it needs,
    "done": O blocks complete on the device after the step} per device] per step],
    "moves": [{operand: the device its next block comes from} per device]}``. Block
    (row, col) indexes the operand's block grid (a dimension not split has one block)."""
    k = _kind(kind)
    if k == "p2x2":
        return _primepar(devices)
    if devices < 2:
        raise ValueError(f"a ring needs at least 2 devices (got {devices})")
    P = devices
    recv = [ring_peers(i, P)[1] for i in range(P)]  # blocks move from recv[i] to i
    steps = []
    if k == "ag_ring":
        held = list(range(P))  # I split on M: device i starts with block i
        done = [[] for _ in range(P)]
        for _ in range(P):
            row = []
            for i in range(P):
                done[i] = done[i] + [(held[i], i)]
                row.append({"I": (held[i], 0), "W": (0, i), "O": (held[i], i), "terms": 1, "of": 1,
                            "done": list(done[i])})
            steps.append(row)
            held = [held[recv[i]] for i in range(P)]
        return {"kind": k, "devices": P, "grids": {"I": (P, 1), "W": (1, P), "O": (P, P)},
                "coords": [str(i) for i in range(P)], "steps": steps, "moves": [{"I": recv[i]} for i in range(P)]}
    # RS-ring: the accumulator device i works on at step t; device i ends with its own block,
    # and the accumulator it adds at step t is the one recv[i] worked on at step t-1
    acc = [[None] * P for _ in range(P)]
    acc[P - 1] = list(range(P))
    for t in range(P - 1, 0, -1):
        for i in range(P):
            acc[t - 1][recv[i]] = acc[t][i]
    terms = [1] * P
    for t in range(P):
        if t:
            terms = [1 + terms[recv[i]] for i in range(P)]
        steps.append([{"I": (acc[t][i], i), "W": (i, 0), "O": (acc[t][i], 0), "terms": terms[i], "of": P,
                       "done": [(acc[t][i], 0)] if terms[i] == P else []} for i in range(P)])
    return {"kind": k, "devices": P, "grids": {"I": (P, P), "W": (P, 1), "O": (P, 1)},
            "coords": [str(i) for i in range(P)], "steps": steps, "moves": [{"O": recv[i]} for i in range(P)]}


def _primepar(devices: int) -> dict:
    kk = round(math.log(devices, 4)) if devices >= 4 else 0
    if kk < 1 or 4 ** kk != devices:
        raise ValueError(f"P(2^k x 2^k) needs 4, 16, 64, ... devices (a 2^k x 2^k grid), got {devices}")
    q = 2 ** kk
    ids = torch.arange(q * q).reshape(q, q)  # block (a, b) of a q x q split holds the number a*q + b

    def block(fn, rank):
        r, c = primepar_coords(rank, kk)
        return divmod(int(fn(ids, r, c, kk)), q)

    cur_i = [block(primepar_shard_input, d) for d in range(devices)]
    cur_w = [block(primepar_shard_weight, d) for d in range(devices)]
    out = [block(primepar_shard_output, d) for d in range(devices)]
    peers = [primepar_peers(d, kk) for d in range(devices)]  # [(I to, I from, tag), (W to, W from, tag)]
    steps = []
    for t in range(q):
        steps.append([{"I": cur_i[d], "W": cur_w[d], "O": out[d], "terms": t + 1, "of": q,
                       "done": [out[d]] if t == q - 1 else []} for d in range(devices)])
        cur_i = [cur_i[peers[d][0][1]] for d in range(devices)]
        cur_w = [cur_w[peers[d][1][1]] for d in range(devices)]
    return {"kind": "p2x2", "devices": devices, "grids": {"I": (q, q), "W": (q, q), "O": (q, q)},
            "coords": [str(primepar_coords(d, kk)) for d in range(devices)], "steps": steps,
            "moves": [{"I": peers[d][0][1], "W": peers[d][1][1]} for d in range(devices)]}


def _ref(op: str, cell, grid) -> str:
    """``I[2,:]``: the block's index per dimension, ``:`` where the dimension is whole."""
    return op + "[" + ",".join(":" if n == 1 else str(x) for x, n in zip(cell, grid)) + "]"


def schedule(kind: str, devices: int = 4, out=None):
    """A grid of panels, devices (rows) x steps (columns): in each, the block grids of I, W
    and O with the block the device holds coloured (O: the block it accumulates into, shaded
    by how much of its sum it holds; blocks complete on the device solid), the step's product
    written below, and where the next block comes from. Returns the Figure; saves it to
    ``out`` when given."""
    s = schedule_blocks(kind, devices)
    n_dev, n_steps, grids = s["devices"], len(s["steps"]), s["grids"]
    fig = new_figure(1.0 + 2.9 * n_steps, 0.9 + 1.45 * n_dev)
    axes = fig.subplots(n_dev, n_steps, squeeze=False)
    gap = 0.45
    for t, row in enumerate(s["steps"]):
        for d, held in enumerate(row):
            ax = axes[d][t]
            ax.add_patch(Rectangle((-0.1, -0.52), 3.2 + 2 * gap, 1.74, facecolor="#f3f3f3", edgecolor="none"))
            for j, op in enumerate(("I", "W", "O")):
                x0 = j * (1 + gap)
                rows, cols = grids[op]
                for a in range(rows):
                    for b in range(cols):
                        cell = (a, b)
                        face, edge = "white", "#bbbbbb"
                        if op == "O" and cell in held["done"]:  # complete on this device
                            face = to_rgba(COLORS["O"], 0.45)
                        if cell == held[op]:
                            edge = "black"
                            face = to_rgba(COLORS[op], 0.25 + 0.75 * held["terms"] / held["of"] if op == "O" else 1)
                        ax.add_patch(Rectangle((x0 + b / cols, 1 - (a + 1) / rows), 1 / cols, 1 / rows,
                                               facecolor=face, edgecolor=edge, linewidth=0.8,
                                               zorder=2 if cell == held[op] else 1))
                ax.add_patch(Rectangle((x0, 0), 1, 1, fill=False, edgecolor="black", linewidth=1, zorder=3))
                ax.text(x0 + 0.5, 1.04, f"{op}[{','.join(DIMS[op])}]", ha="center", va="bottom", fontsize=7)
            ax.text(1 + gap / 2, 0.5, "·", ha="center", va="center", fontsize=12)
            ax.text(2 + 1.5 * gap, 0.5, "→", ha="center", va="center", fontsize=10)
            acc = "" if held["of"] == 1 else f"  (its sum: {held['terms']}/{held['of']})"
            ax.text(1.5 + gap, -0.1, " · ".join(_ref(op, held[op], grids[op]) for op in ("I", "W")) + " → "
                    + _ref("O", held["O"], grids["O"]) + acc, ha="center", va="top", fontsize=7)
            if t < n_steps - 1:
                nxt = ", ".join(f"{op} from device {s['moves'][d][op]}" for op in s["moves"][d])
                ax.text(1.5 + gap, -0.32, f"next: {nxt}", ha="center", va="top", fontsize=6.5, color="#555555")
            ax.set_xlim(-0.12, 3.12 + 2 * gap)
            ax.set_ylim(-0.54, 1.24)
            ax.set_aspect("equal")
            ax.axis("off")
            if d == 0:
                ax.set_title(f"step {t}", fontsize=9)
            if t == 0:
                ax.text(-0.2, 0.5, f"device {d}" + (f"\n{s['coords'][d]}" if s["kind"] == "p2x2" else ""),
                        ha="right", va="center", fontsize=8)
    where = {"ag_ring": "I blocks move from device i+1 to i (ring_peers)",
             "rs_ring": "output accumulators move from device i+1 to i (ring_peers)",
             "p2x2": "I moves along grid rows from (r, c+1), W along columns from (r+1, c) (primepar_peers); "
                     "device (r, c) = r·2^k + c"}[s["kind"]]
    width = int(fig.get_figwidth() * 15)  # characters a title line holds at this size
    lines = [f"{KINDS[s['kind']]} on {n_dev} devices, forward: O[M,K] = I[M,N] · W[N,K]",
             "coloured, black edge: the block each device holds at each step (O: shaded by how much of its sum "
             "it holds); light green: O blocks complete on the device", where]
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in lines), fontsize=9)
    return save(fig, out)


__all__ = ["schedule", "schedule_blocks", "KINDS"]
