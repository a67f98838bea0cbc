"""strategies: the candidate partitions of every node.

Each aten op is described by an einsum-like :class:`OpSpec` — one label per
dimension of every tensor operand and of the output, which labels may be split,
which are contracted (splitting them leaves a Partial output) — and the
enumerator takes the product over mesh axes of the per-axis options:

  replicate            every operand and the output R
  shard label L        operands holding L get S(dim of L), the output S(dim of L)
  contract label L     operands holding L get S(dim of L), the output P
  partial pass-through linear elementwise ops keep a Partial input Partial
  block (2-D)          elementwise ops on a 4^k axis keep PrimePar's B layout (an
                       operand along the last dim only, whole: its grid column's
                       slice read), and so does a LayerNorm or RMSNorm over the last
                       dim (its statistics exchanged along the grid row:
                       ``runtime.grid_layer_norm``, ``runtime.grid_rms_norm``), and
                       attention (batch over the grid's rows, heads over its columns:
                       scaled_dot_product_attention, or q @ k^T, softmax and @ v)

Matmul-like nodes (aten.linear) also get the spatial-temporal families of
shared/DESIGN.md on one axis: ``ag_ring`` (all-gather fused into the matmul),
``rs_ring`` (reduce-scatter fused into the matmul) and ``p2x2`` (PrimePar's
P(2^k x 2^k) on an axis of 4^k devices). Ops with no rule get one all-replicate
strategy and are reported (``FALLBACK``).

Views and unary elementwise ops are *followers*: they have no choice of their
own; :func:`follow` maps the producer's placement through them.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from stpc.placement import PARTIAL, REPLICATE, _fits, block, fits, parse, shard

aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the mesh.

    ``ins`` has one placement per tensor operand (in ``tensor_operands`` order),
    ``out`` the output placement. ``kind`` is the family: ``spatial``,
    ``ag_ring``, ``rs_ring``, ``p2x2`` or ``replicate-fallback``; ``axis`` the
    mesh axis a temporal family runs on (-1 for spatial).
    """

    out: tuple[str, ...]
    ins: tuple[tuple[str, ...], ...]
    kind: str = "spatial"
    axis: int = -1

    def split_axes(self) -> tuple[bool, ...]:
        """Per axis: is the work divided (any operand or the output not replicated)?"""
        got = self.__dict__.get("_split_axes")  # memoised: the planner asks per edge and axis
        if got is None:
            got = tuple([col.count(REPLICATE) != len(col) for col in zip(self.out, *self.ins)])
            object.__setattr__(self, "_split_axes", got)
        return got

    def describe(self) -> str:
        tag = "" if self.kind == "spatial" else f"{self.kind}@{self.axis} "
        return tag + "(" + ",".join(self.out) + ")"


@dataclass
class OpSpec:
    """Labels of each tensor operand and the output; which labels may be split."""

    ins: list[tuple[str, ...]]
    out: tuple[str, ...]
    contract: frozenset = frozenset()   # splitting these gives a Partial output
    fixed: frozenset = frozenset()      # never split (normalised dims, softmax dims, ...)
    partial: str = ""                   # "all": P in all operands -> P out; "first": P in operand 0 only
    grid: bool = False                  # may keep PrimePar's B layout (over ``grid_pairs``' dims)
    grid_norm: bool = False             # a norm over the last dim that keeps the B layout: its
                                        # statistics exchanged along the grid row, its 1-D
                                        # operands whole (runtime.grid_layer_norm)
    grid_loss: bool = False             # a cross-entropy that may read [N, V] logits in the B
                                        # layout, the target whole (runtime.grid_cross_entropy)
    kind: str = "spatial"
    additive: tuple = ()                # operands added to the output (a linear's bias): they
                                        # must be Partial when the output is (added once in the sum)


# --------------------------------------------------------------------- op tables

_UNARY_LINEAR = {aten.neg.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
                 aten.contiguous.default if hasattr(aten, "contiguous") else aten.clone.default,
                 aten.lift_fresh_copy.default, aten.detach.default, aten.to.dtype, aten.to.dtype_layout,
                 aten.type_as.default}
_UNARY = {aten.gelu.default, aten.relu.default, aten.silu.default, aten.sigmoid.default,
          aten.tanh.default, aten.exp.default, aten.log.default, aten.rsqrt.default, aten.sqrt.default,
          aten.cos.default, aten.sin.default, aten.pow.Tensor_Scalar, aten.dropout.default,
          aten.masked_fill.Scalar, aten.pow.Scalar, aten.reciprocal.default, aten.abs.default,
          aten.gelu.default} | _UNARY_LINEAR
_SCALAR_LINEAR = {aten.mul.Scalar, aten.div.Scalar}
_BINARY_ADD = {aten.add.Tensor, aten.sub.Tensor}
_BINARY_MUL = {aten.mul.Tensor, aten.div.Tensor}
_BINARY = _BINARY_ADD | _BINARY_MUL | {aten.where.self, aten.masked_fill.Tensor, aten.maximum.default,
                                       aten.minimum.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
          aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.expand.default, aten.slice.Tensor, aten.select.int, aten.repeat_interleave.self_int,
          aten.flatten.using_ints}
_MATMUL = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default, aten.addmm.default}

# Ops whose backward keeps (some of) their inputs: used for activation memory.
SAVES_INPUTS = _MATMUL | {aten.scaled_dot_product_attention.default, aten.layer_norm.default, aten.rms_norm.default,
                          aten.gelu.default, aten.silu.default, aten.relu.default, aten.sigmoid.default,
                          aten.tanh.default, aten.pow.Tensor_Scalar, aten.mul.Tensor, aten.div.Tensor,
                          aten.cross_entropy_loss.default, aten.embedding.default}
SAVES_OUTPUT = {aten.scaled_dot_product_attention.default, aten.rsqrt.default, aten.exp.default,
                aten.softmax.int, aten._softmax.default, aten.log_softmax.int}


def tensor_operands(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued inputs, in argument order (duplicates kept)."""
    out = []
    for a in itertools.chain(node.args, node.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
                out.append(x)
    return out


def _shape(n) -> tuple[int, ...]:
    return tuple(int(s) for s in n.meta["val"].shape)


def _labels(prefix: str, k: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(k))


def _broadcast_spec(operands, out_shape, fixed_dims=()) -> OpSpec:
    """Elementwise with numpy broadcasting: labels align from the right; a size-1
    broadcast dim gets its own label so it is never split."""
    out = _labels("d", len(out_shape))
    ins = []
    for i, o in enumerate(operands):
        shp = _shape(o)
        lab = list(out[len(out) - len(shp):])
        for j, s in enumerate(shp):
            if s == 1 and out_shape[len(out) - len(shp) + j] != 1:
                lab[j] = f"b{i}_{j}"
        ins.append(tuple(lab))
    fixed = frozenset(out[d] for d in fixed_dims) | frozenset(
        l for lab in ins for l in lab if l.startswith("b"))
    return OpSpec(ins=ins, out=out, fixed=fixed)


def op_spec(node: fx.Node) -> OpSpec | None:
    """The einsum-like description of ``node``'s op, or None if stpc has no rule for it."""
    t = node.target
    ops = tensor_operands(node)
    out_shape = _shape(node) if isinstance(node.meta.get("val"), torch.Tensor) else ()
    if t in (aten.linear.default,):
        x = _labels("m", len(_shape(ops[0])) - 1) + ("n",)
        ins = [x, ("k", "n")] + ([("k",)] if len(ops) == 3 else [])
        return OpSpec(ins=ins, out=x[:-1] + ("k",), contract=frozenset("n"), kind="linear",
                      additive=(2,) if len(ops) == 3 else ())
    if t is aten.addmm.default and len(ops) == 3:  # bias + x @ w (Hugging Face's GPT-2 Conv1D)
        b = _shape(ops[0])
        full = ("i", "k")[2 - len(b):] if len(b) <= 2 else None
        if full is None:
            return None
        bias = tuple(f"b{j}" if s == 1 and out_shape[2 - len(b) + j] != 1 else full[j] for j, s in enumerate(b))
        return OpSpec(ins=[bias, ("i", "n"), ("n", "k")], out=("i", "k"), contract=frozenset("n"),
                      fixed=frozenset(l for l in bias if l.startswith("b")), additive=(0,))
    if t in (aten.mm.default, aten.bmm.default, aten.matmul.default):
        a, b = _shape(ops[0]), _shape(ops[1])
        if len(a) < 2 or len(b) != 2 and len(b) != len(a):
            return None
        batch = _labels("m", len(a) - 2)
        ins = [batch + ("i", "n"), (batch if len(b) == len(a) else ()) + ("n", "k")]
        # grid: attention's scores as q @ k^T, batch and heads in blocks (``grid_pairs``)
        return OpSpec(ins=ins, out=batch + ("i", "k"), contract=frozenset("n"), grid=True)
    if t is aten.scaled_dot_product_attention.default:
        q, k, v = (_shape(o) for o in ops[:3])
        lead = _labels("z", len(q) - 3)
        ins = [lead + ("h", "s", "e"), lead + ("h", "t", "e"), lead + ("h", "t", "f")]
        if len(ops) > 3:  # attention mask/bias, broadcast against [.., h, s, t]
            m = _shape(ops[3])
            full = lead + ("h", "s", "t")
            lab = list(full[len(full) - len(m):])
            for j, s in enumerate(m):
                if s == 1:
                    lab[j] = f"bm{j}"
            ins.append(tuple(lab))
        # Only batch and head dims split: a split sequence needs ring attention.
        # grid: batch over the grid's rows, heads over its columns, as a P(2x2) q projection
        # with batch rows leaves them (``grid_pairs``): no exchange at all
        return OpSpec(ins=ins, out=lead + ("h", "s", "f"), fixed=frozenset({"s", "t", "e", "f"}), grid=True)
    if t in (aten.layer_norm.default, aten.rms_norm.default):  # (rms_norm: frontend.normalize's fusion)
        nd = len(node.args[1])
        x = _labels("d", len(_shape(ops[0])))
        norm = frozenset(x[-nd:])
        ins = [x] + [x[-nd:]] * (len(ops) - 1)
        # runtime.grid_rms_norm runs RMSNorm as stpc.trace fuses it: no weight (its mul a node
        # of its own), eps given; torch.nn.RMSNorm's own rms_norm(x, shape, weight) keeps no grid
        gridded = t is aten.layer_norm.default or (len(ops) == 1 and len(node.args) > 3 and node.args[3] is not None)
        return OpSpec(ins=ins, out=x, fixed=norm, grid_norm=nd == 1 and len(x) >= 2 and gridded)
    if t is aten.embedding.default:
        idx = _labels("i", len(_shape(ops[1])))
        # Splitting the vocabulary is Megatron's vocab-parallel embedding: a masked
        # local lookup whose sum over ranks is the result (Partial).
        return OpSpec(ins=[("v", "e"), idx], out=idx + ("e",), contract=frozenset("v"))
    if t is aten.cross_entropy_loss.default:
        lg = _shape(ops[0])
        rows = _labels("t", len(lg) - 1)
        # Row-split: each rank's mean over its rows; the pass rescales (mean of means).
        # grid_loss: [N, V] logits in a block layout (rows over the grid's rows, the
        # vocabulary over its columns), the target whole: runtime.grid_cross_entropy
        # exchanges row statistics (no class weights, no smoothing, a mean or a sum)
        reduction = node.kwargs.get("reduction", node.args[3] if len(node.args) > 3 else 1)
        smoothing = node.kwargs.get("label_smoothing", node.args[5] if len(node.args) > 5 else 0.0)
        plain = len(ops) == 2 and len(lg) == 2 and reduction in (1, 2) and not smoothing
        return OpSpec(ins=[rows + ("v",), rows][: len(ops)], out=(), contract=frozenset(rows),
                      fixed=frozenset({"v"}), grid_loss=plain)
    if t in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.mean.default, aten.sum.default):
        x = _labels("d", len(_shape(ops[0])))
        dims = [d % len(x) for d in (node.args[1] if len(node.args) > 1 else range(len(x)))]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        out = tuple(f"r{d}" if d in dims else l for d, l in enumerate(x)) if keep else \
            tuple(l for d, l in enumerate(x) if d not in dims)
        reduced = frozenset(x[d] for d in dims)
        return OpSpec(ins=[x], out=out, contract=reduced if t is not aten.amax.default else frozenset(),
                      fixed=frozenset(f"r{d}" for d in dims) | (reduced if t is aten.amax.default
                                                                else frozenset()))
    if t in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default):
        x = _labels("d", len(_shape(ops[0])))
        return OpSpec(ins=[x], out=x, fixed=frozenset({x[node.args[1] % len(x)]}), grid=True)
    if t is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        spec = _broadcast_spec(ops, out_shape, fixed_dims=(dim % len(out_shape),))
        spec.grid = True  # (RoPE's rotate-half: a cat along head_dim, heads and batch in blocks)
        return spec
    if t in _BINARY:
        spec = _broadcast_spec(ops, out_shape)
        if t in _BINARY_ADD:
            spec.partial = "all"
        elif t in _BINARY_MUL:
            spec.partial = "first"
        spec.grid = t in _BINARY_ADD or t in _BINARY_MUL
        return spec
    if t in _UNARY or t in _SCALAR_LINEAR:
        spec = _broadcast_spec(ops, out_shape)
        spec.partial = "all" if (t in _UNARY_LINEAR or t in _SCALAR_LINEAR) else ""
        spec.grid = True
        return spec
    if _is_pointwise(t) and ops:
        # Any other elementwise aten op (clamp, softplus, erf, lerp, addcmul, ...): every
        # dim splits, broadcasting as numpy does; no Partial (it need not be linear).
        return _broadcast_spec(ops, out_shape)
    return None


def _is_pointwise(t) -> bool:
    """aten's own tag for elementwise ops; seeded-random ones (dropout, bernoulli) are
    left out: each rank would draw different numbers than one device does."""
    tags = getattr(t, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def is_view_like(node: fx.Node) -> bool:
    """Aliases its operand's storage (repeat_interleave follows placements like a view
    but writes a new tensor: GQA's repeated K/V are what attention saves)."""
    return node.target in _VIEWS and node.target is not aten.repeat_interleave.self_int


def is_follower(node: fx.Node, operands: list | None = None) -> bool:
    """One tensor operand and a placement that follows from it: views and unary ops.
    ``operands``: the node's ``tensor_operands`` when the caller has them."""
    if node.op != "call_function":
        return False
    if not (node.target in _VIEWS or node.target in _UNARY or node.target in _SCALAR_LINEAR):
        return False
    return len(tensor_operands(node) if operands is None else operands) == 1


# --------------------------------------------------------------------- enumeration


def _axis_options(spec: OpSpec, shapes_in, out_shape, axis_size: int):
    """Per-axis options: (out token, tuple of operand tokens)."""
    opts = [(REPLICATE, tuple(REPLICATE for _ in spec.ins))]
    if axis_size == 1:
        return opts
    for lab in dict.fromkeys(spec.out):
        if lab in spec.fixed:
            continue
        ins = tuple(shard(l.index(lab)) if lab in l else REPLICATE for l in spec.ins)
        opts.append((shard(spec.out.index(lab)), ins))
    for lab in sorted(spec.contract):
        if lab in spec.fixed or not any(lab in l for l in spec.ins):
            continue
        ins = tuple(shard(l.index(lab)) if lab in l else (PARTIAL if k in spec.additive else REPLICATE)
                    for k, l in enumerate(spec.ins))
        opts.append((PARTIAL, ins))
    if spec.partial == "all":
        opts.append((PARTIAL, tuple(PARTIAL for _ in spec.ins)))
    elif spec.partial == "first" and spec.ins:
        opts.append((PARTIAL, (PARTIAL,) + tuple(REPLICATE for _ in spec.ins[1:])))
    g = math.isqrt(axis_size)
    if spec.grid_loss and g * g == axis_size:
        # the loss of [N, V] logits in blocks: each device its rows' share (Partial)
        opts.append((PARTIAL, (block("B", 0, 1), REPLICATE)))
    if (spec.grid or spec.grid_norm) and g * g == axis_size and len(spec.out) >= 2:
        for i, j in grid_pairs(len(spec.out), spec.grid_norm):
            li, lj = spec.out[i], spec.out[j]
            if li in spec.fixed or (lj in spec.fixed and not (spec.grid_norm and j == len(spec.out) - 1)):
                continue
            ins = []
            for l in spec.ins:
                if li in l and lj in l:
                    ins.append(block("B", l.index(li), l.index(lj)))
                elif li not in l and lj not in l:
                    # whole, and read whole: a grid norm's weight and bias (sliced by the
                    # runtime op), a broadcast operand along neither split dim (RoPE's
                    # tables, a causal mask beside heads and batch split)
                    ins.append(REPLICATE)
                elif li not in l and (not spec.grid_norm or l[-1:] == (lj,)):
                    # along the block's columns, not its rows (RMSNorm's weight; a mask that
                    # varies per head, beside heads over the grid's columns): whole, each
                    # device reads its grid column's slice (runtime.grid_column; a norm's
                    # weight and bias, the norm's runtime op)
                    ins.append(REPLICATE)
                else:
                    ins = None
                    break
            if ins is not None:
                opts.append((block("B", i, j), tuple(ins)))
    return opts


def grid_pairs(rank: int, norm: bool = False) -> tuple[tuple[int, int], ...]:
    """The (row dim, column dim) pairs a result of ``rank`` dims may hold PrimePar's block
    layout over: its last two (a P(2x2) linear's sequence rows and hidden columns); for a
    [batch, seq, hidden] activation also batch rows, hidden columns (the layout a P(2x2)
    linear with batch rows leaves, which attention can keep: its heads lie along hidden);
    for a [batch, heads, seq, head_dim] one batch rows and head columns (attention's own
    split, no sequence cut). A norm over the last dim keeps only layouts whose columns
    are that dim (``runtime.grid_layer_norm`` exchanges statistics along the grid row)."""
    pairs = [(rank - 2, rank - 1)]
    if rank == 3:
        pairs.append((0, 2))
    if rank == 4 and not norm:
        pairs.append((0, 1))
    return tuple(pairs)


def enumerate_spatial(spec: OpSpec, shapes_in, out_shape, mesh: tuple[int, ...]) -> list[Strategy]:
    per_axis = [_axis_options(spec, shapes_in, out_shape, n) for n in mesh]
    shapes_in, out_shape, mesh = [tuple(s) for s in shapes_in], tuple(out_shape), tuple(mesh)
    out = []
    for combo in itertools.product(*per_axis):
        o = tuple([c[0] for c in combo])
        if PARTIAL in o and any(t[0] in "BXW" for t in o):
            continue
        if not _fits(out_shape, o, mesh):
            continue
        ins = tuple(zip(*[c[1] for c in combo]))  # per operand: its token on each axis
        if ins and not _grid_nests(o, ins[0]):
            continue
        if all(_fits(sh, p, mesh) for sh, p in zip(shapes_in, ins)):
            out.append(Strategy(o, ins))
    return out


def _grid_nests(out: tuple[str, ...], first: tuple[str, ...]) -> bool:
    """Whether a block layout in a spatial strategy keeps placements true. Splits nest
    outer axis first (``stpc.placement``); a grid's blocks nest inside an earlier axis's
    split of their dims, but a later axis splitting them would cut each block's piece
    across the grid (an operand read whole beside the block and sliced by its grid column,
    ``runtime.grid_column``, would be cut the other way round; a grid loss's whole target
    would miss its rows: wrong answers). And one grid per strategy: the runtime's grid ops
    (norms, the loss, column slices) exchange and slice over one axis. ``first``: the first
    operand's placement (a cross-entropy's logits, in a block where its output is Partial)."""
    grids = [(a, t) for a, t in enumerate(out) if t[0] in "BXW"]
    held = out
    if not grids:
        grids, held = [(a, t) for a, t in enumerate(first) if t[0] in "BXW"], first
    if len(grids) > 1 or len([t for t in first if t[0] in "BXW"]) > 1:
        return False
    if not grids:
        return True
    a, tok = grids[0]
    cut = {shard(d) for d in parse(tok)[1]}
    return all(held[b] not in cut for b in range(a + 1, len(held)))


def derive(node: fx.Node, live: dict[int, tuple[str, ...]], mesh: tuple[int, ...],
           cache: dict | None = None) -> Strategy | None:
    """The strategy of a node whose live (non-constant) operands arrive in the given
    placements (operand index -> placement) and are not moved: per axis, the spatial
    option whose tokens for those operands are theirs. None when no option keeps them
    (they must be gathered to Replicate first). Constant operands take whatever the
    option asks: they are computed replicated, so slicing them (or R -> P) is free."""
    order = tuple(sorted(live))
    table = _derive_table(node, order, mesh, {} if cache is None else cache)
    if table is None:
        return None
    per_axis, _, shapes_in, out_shape = table
    places = [live[k] for k in order]
    picks = []
    for a, options in enumerate(per_axis):
        pick = options.get(tuple([p[a] for p in places]))
        if pick is None:
            return None
        picks.append(pick)
    out = tuple([o for o, _ in picks])
    ins = tuple(zip(*[i for _, i in picks]))  # per operand: its token on each axis
    mesh = tuple(mesh)
    if not _fits(out_shape, out, mesh) or not all(_fits(sh, q, mesh) for sh, q in zip(shapes_in, ins)):
        return None
    return Strategy(out, ins)


def _derive_table(node, live: tuple[int, ...], mesh, cache: dict):
    """Per axis: the live operands' tokens -> the (out, ins) option keeping them
    (preferring a replicated output). Cached in ``cache`` per node, operands and mesh."""
    key = (node, live, mesh)
    if key in cache:
        return cache[key]
    spec = op_spec(node)
    ops = tensor_operands(node)
    if spec is None or len(spec.ins) != len(ops):
        cache[key] = None
        return None
    shapes_in = [_shape(o) for o in ops]
    out_shape = _shape(node)
    per_axis = []
    for n in mesh:
        d = {}
        for o, i in _axis_options(spec, shapes_in, out_shape, n):
            k = tuple(i[j] for j in live)
            if k not in d or o == REPLICATE:
                d[k] = (o, i)
        per_axis.append(d)
    cache[key] = (per_axis, len(spec.ins), shapes_in, out_shape)
    return cache[key]


def _ring_nests(kind: str, a: int, s: Strategy, m_dim: int, k_dim: int) -> bool:
    """Whether a ring on axis ``a`` added to spatial strategy ``s`` keeps placements true.

    A dim split over several axes is nested outer axis first (``stpc.placement``). An
    AG-ring gathers the rows (``m_dim``) of x over axis ``a``, an RS-ring scatters the
    output rows over it: where another axis splits the same rows too, the ring's piece
    is the inner one, which is right only if that other axis comes first (a later one
    would leave each rank a block of rows that is no chunk of the full dim: a wrong
    answer, not a slow one). P(2^k x 2^k) blocks the rows and the output columns
    (``k_dim``) on its axis: its row blocks nest inside an earlier axis's split of the rows
    (data parallelism outside a grid with batch rows), no later axis may split them, and
    no other axis may split the output columns."""
    x, out = s.ins[0], s.out
    rows = shard(m_dim)
    if kind in ("ag_ring", "rs_ring"):
        split_rows = x if kind == "ag_ring" else out
        return all(split_rows[b] != rows for b in range(a + 1, len(out)))
    cols = shard(k_dim)
    return (all(out[b] != cols for b in range(len(out)) if b != a)
            and all(out[b] != rows and x[b] != rows for b in range(a + 1, len(out))))


def _linear_temporal(node: fx.Node, spatial: list[Strategy], mesh, shapes_in, out_shape) -> list[Strategy]:
    """AG-ring, RS-ring and P2x2 variants of aten.linear, composed with the spatial
    choices of the other axes."""
    x_nd = len(shapes_in[0])
    if x_nd < 2:
        return []
    # P2x2's rows: the sequence dim of the activation, or (on [batch, seq, hidden]) the batch
    # dim, whose block layout attention keeps (``grid_pairs``)
    rows = (x_nd - 2, 0) if x_nd == 3 else (x_nd - 2,)
    k_dim = len(out_shape) - 1
    has_bias = len(shapes_in) == 3
    res = []
    for a, n in enumerate(mesh):
        if n == 1:
            continue
        # Start from spatial strategies that replicate this axis: the family owns it.
        base = [s for s in spatial if s.out[a] == REPLICATE and all(p[a] == REPLICATE for p in s.ins)]
        m_dim = rows[0]
        fams = [
            # AG-ring: x rows sharded, W sharded on K -> out sharded on K.
            ("ag_ring", m_dim, shard(k_dim), (shard(m_dim), "S0") + (("S0",) if has_bias else ())),
            # RS-ring: contraction sharded -> out rows sharded; the bias is added to the
            # reduced block, so it stays replicated.
            ("rs_ring", m_dim, shard(m_dim), (shard(x_nd - 1), "S1") + ((REPLICATE,) if has_bias else ())),
        ]
        g = math.isqrt(n)
        if g * g == n and g > 1:
            # P2x2: the bias whole, its grid column's slice added to the output block
            # (runtime.grid_bias_add)
            fams += [("p2x2", r, block("B", r, k_dim),
                      (block("X", r, x_nd - 1), block("W", 0, 1)) + ((REPLICATE,) if has_bias else ()))
                     for r in rows]
        for kind, m_dim, otok, itoks in fams:
            for s in base:
                if not _ring_nests(kind, a, s, m_dim, k_dim):
                    continue
                o = s.out[:a] + (otok,) + s.out[a + 1:]
                ins = tuple(p[:a] + (itoks[i],) + p[a + 1:] for i, p in enumerate(s.ins))
                if fits(out_shape, o, mesh) and all(fits(sh, p, mesh) for sh, p in zip(shapes_in, ins)):
                    res.append(Strategy(out=o, ins=ins, kind=kind, axis=a))
    return res


def enumerate_strategies(node: fx.Node, mesh: tuple[int, ...], temporal: bool = True,
                         cache: dict | None = None) -> tuple[list[Strategy], bool]:
    """All strategies of a decision node; the bool says the op had no rule (fallback).

    ``cache``: nodes whose op spec is the same and whose dims divide alike on this mesh
    (q, k, v, o and the MLP's linears) get the same list, computed once (treat it as
    read-only). A dim's divisibility by any product of mesh axes is set by its gcd with
    the device count, so that gcd stands for the dim in the key."""
    ops = tensor_operands(node)
    shapes_in = [_shape(o) for o in ops]
    val = node.meta.get("val")
    out_shape = _shape(node) if isinstance(val, torch.Tensor) else ()
    rep = Strategy(out=tuple(REPLICATE for _ in mesh), ins=tuple(tuple(REPLICATE for _ in mesh) for _ in ops))
    spec = op_spec(node) if isinstance(val, torch.Tensor) else None
    if spec is None or len(spec.ins) != len(ops):
        return [Strategy(out=rep.out, ins=rep.ins, kind="replicate-fallback")], True
    key = None
    if cache is not None:
        n = math.prod(mesh)
        key = (tuple(spec.ins), spec.out, spec.contract, spec.fixed, spec.partial, spec.grid, spec.grid_norm,
               spec.grid_loss, spec.kind,
               spec.additive, tuple(mesh), temporal,
               tuple(tuple(math.gcd(d, n) for d in sh) for sh in [*shapes_in, out_shape]))
        got = cache.get(key)
        if got is not None:
            return got, False
    strategies = enumerate_spatial(spec, shapes_in, out_shape, mesh)
    if temporal and spec.kind == "linear":
        strategies += _linear_temporal(node, strategies, mesh, shapes_in, out_shape)
    if key is not None:
        cache[key] = strategies
    return strategies, False


def placement_choices(shape: tuple[int, ...], mesh: tuple[int, ...], grid_weight: bool = True) -> list[tuple[str, ...]]:
    """Every placement a parameter may be stored in: per axis R or S(d); on a 4^k axis
    also PrimePar's weight layout for 2-D weights."""
    per_axis = []
    for n in mesh:
        opts = [REPLICATE] + ([shard(d) for d in range(len(shape))] if n > 1 else [])
        g = math.isqrt(n)
        if grid_weight and g * g == n and g > 1 and len(shape) == 2:
            opts.append(block("W", 0, 1))
        per_axis.append(opts)
    return [p for p in itertools.product(*per_axis) if fits(shape, p, mesh)]


# --------------------------------------------------------------------- followers


def _view_dim_map(in_shape, out_shape) -> dict[int, int] | None:
    """For view/reshape: input dim -> output dim whose *leading* part it becomes.

    Dims are matched in groups of equal products; a split input dim maps to the
    first output dim of its group (so a Shard survives when that dim divides),
    merged input dims map only the first one.
    """
    m, i, j = {}, 0, 0
    while i < len(in_shape) and j < len(out_shape):
        gi, go = [i], [j]
        pi, po = in_shape[i], out_shape[j]
        while pi != po:
            if pi < po:
                i += 1
                if i >= len(in_shape):
                    return None
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                if j >= len(out_shape):
                    return None
                go.append(j)
                po *= out_shape[j]
        m[gi[0]] = go[0]
        i, j = i + 1, j + 1
    return m


def follow(node: fx.Node, p: tuple[str, ...], mesh: tuple[int, ...]) -> tuple[str, ...] | None:
    """The output placement of follower ``node`` given its input placement ``p``,
    or None when it cannot be kept (the input must be made Replicate first)."""
    return follow_rule(node)(p, mesh)


def follow_rule(node: fx.Node):
    """``follow`` for one node as a function of (placement, mesh): the node's dim map
    is worked out once (the planner asks for every placement of its producer)."""
    t = node.target
    (src,) = tensor_operands(node)
    in_shape, out_shape = _shape(src), _shape(node)
    if t in _UNARY or t in _SCALAR_LINEAR:
        keeps_partial = t in _UNARY_LINEAR or t in _SCALAR_LINEAR
        return lambda p, mesh: None if (PARTIAL in p and not keeps_partial) else p
    if t in (aten.transpose.int, aten.permute.default, aten.t.default):
        nd = len(in_shape)
        if t is aten.t.default:
            perm = list(range(nd))[::-1]
        elif t is aten.transpose.int:
            d0, d1 = node.args[1] % nd, node.args[2] % nd
            perm = list(range(nd))
            perm[d0], perm[d1] = perm[d1], perm[d0]
        else:
            perm = [d % nd for d in node.args[1]]
        dmap = {src_d: out_d for out_d, src_d in enumerate(perm)}
    elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints):
        dmap = _view_dim_map(in_shape, out_shape)
        if dmap is None:
            return lambda p, mesh: None
    elif t is aten.unsqueeze.default:
        d = node.args[1] % (len(in_shape) + 1)
        dmap = {i: (i if i < d else i + 1) for i in range(len(in_shape))}
    elif t is aten.squeeze.dim:
        d = node.args[1] % len(in_shape)
        dmap = {i: (i if i < d else i - 1) for i in range(len(in_shape)) if i != d}
    elif t is aten.expand.default:
        off = len(out_shape) - len(in_shape)
        dmap = {i: i + off for i in range(len(in_shape)) if in_shape[i] == out_shape[i + off]}
    elif t is aten.slice.Tensor:
        d = node.args[1] % len(in_shape) if len(node.args) > 1 else 0
        dmap = {i: i for i in range(len(in_shape)) if i != d or in_shape[i] == out_shape[i]}
    elif t is aten.select.int:
        d = node.args[1] % len(in_shape)
        dmap = {i: (i if i < d else i - 1) for i in range(len(in_shape)) if i != d}
    elif t is aten.repeat_interleave.self_int:
        # Each source slice's repeats stay together, so a split of the repeated dim survives.
        dmap = {i: i for i in range(len(in_shape))}
    else:
        return lambda p, mesh: None
    no_partial = t is aten.expand.default
    tokens: dict[str, str | None] = {}

    def rule(p, mesh):
        if no_partial and PARTIAL in p:
            return None
        out = []
        for tok in p:
            q = tokens.get(tok, "")
            if q == "":
                q = tokens[tok] = _map_token(tok, dmap)
            if q is None:
                return None
            out.append(q)
        out = tuple(out)
        return out if fits(out_shape, out, mesh) else None
    return rule


def _map_token(tok: str, dmap: dict) -> str | None:
    kind, dims = parse(tok)
    if kind in "RP":
        return tok
    if all(d in dmap for d in dims):
        return kind + ".".join(str(dmap[d]) for d in dims)
    return None
