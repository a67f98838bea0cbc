"""Hints: constraints users (and baselines) put on the search, and the presets.

``megatron(mesh_shape, dp_axis, tp_axis)`` reproduces Megatron-LM's tensor + sequence
parallel layout on the TP axis and data parallelism on the DP axis: column-parallel
q/k/v/fc1/gate/up projections and the vocab-parallel head and embedding (weight
Shard(0)), row-parallel o/fc2/down projections (weight Shard(1)), no
spatial-temporal families, replicated weights on the data axis with the batch split
there. The glue between them (norms, residual adds, attention) is left to the solver,
which on the same cost model picks the sequence-parallel layout where it is cheaper.
Without axes it puts TP on the last (innermost) axis and DP on the first.

``fsdp_tp(mesh_shape, dp_axis, tp_axis)`` is TorchTitan's 2-D default: the same TP+SP
on the TP axis, and every parameter stored sharded over the DP axis (FSDP, ZeRO-3),
gathered whole for its op (all-gather forward, reduce-scatter of the gradient
backward; both overlap compute as FSDP's prefetch does, ``cost_models.overlap``).

The presets searched over their whole layout space (every DP x TP factorisation and
axis order) live in ``stpc.planner.baselines``.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class HintUnsatisfiable(ValueError):
    """A hint leaves some node without a strategy on this mesh."""


# (None: the search decides; ``Hints.recompute``)
RECOMPUTE_LEVELS = (None, "none", "selective", "full")


@dataclass
class Hints:
    """Constraints on the search.

    ``force`` maps a regular expression (matched against a node's name and its
    module path) to a predicate over :class:`Strategy`; matching decision nodes
    keep only the strategies the predicate accepts. ``param_force`` does the
    same for parameters, on their FQN and placement tuple. ``param_exact``
    (parameter FQN -> placement) and ``input_exact`` (user-input placeholder
    name -> placement) pin one placement each: where the mesh cannot hold it the
    search raises :class:`HintUnsatisfiable` (a compiled model re-planned for new
    input shapes keeps its parameters where they are; a data loader that feeds
    shards fixes its inputs' placements).

    ``keep_gathered``: mesh axes over which a parameter stored sharded and read whole is
    gathered once per step and kept for backward (ZeRO-2: FSDP's ``SHARD_GRAD_OP``, FSDP2's
    ``reshard_after_forward=False``), where by default (ZeRO-3, FSDP2's default) backward
    gathers it again (``runtime.RegatherSaved``). The planner charges the kept copies as
    memory saved for backward and no second gather; the plan records it
    (``plan.stats["keep_gathered"]``) and the compiled model runs it so. Megatron's
    distributed optimizer is planned and run this way (see :func:`megatron`).

    ``sequence_parallel``: a mesh axis on which the glue between the linears (norms and
    residual adds: :func:`sequence_parallel_nodes`) keeps its activations split on the
    sequence, Megatron's ``--sequence-parallel`` and TorchTitan's
    ``SequenceParallel``; None leaves that layout to the solver, which picks it where the
    cost model finds it faster.

    ``recompute``: activation recomputation of the repeated layers (``passes.recompute``:
    each layer's forward replayed in backward, keeping only its inputs). ``"full"``:
    always; ``"selective"``: always, but each layer's plain matmuls and fused attentions
    keep their outputs and are not replayed (``analysis.kept_when_selective``; the norms,
    activations and communication between them are); ``"none"``: never; None: the search
    decides, trying selective and then full wherever the plan without it does not fit the
    budget at its memory-blind optimum (with it every plan is slower, so it can only win
    where the budget binds). A recomputed layer's weights are
    gathered again by its replay whatever ``keep_gathered`` says (it still holds outside the layers).

    ``recompute_layers``: under ``"full"`` or ``"selective"``, how many layers are
    recomputed, the first ones in the program (Megatron's ``--recompute-num-layers``): their
    saved activations live longest, and once backward reaches them the later layers' are
    freed, so the replay never adds to the end of forward's peak. None: every layer. The
    recomputed layers and the others are tied apart (each kind plans its own strategies).
    """

    force: list[tuple[str, callable]] = field(default_factory=list)
    param_force: list[tuple[str, callable]] = field(default_factory=list)
    param_exact: dict[str, tuple[str, ...]] = field(default_factory=dict)
    input_exact: dict[str, tuple[str, ...]] = field(default_factory=dict)
    temporal: bool = True
    name: str = ""
    keep_gathered: tuple[int, ...] = ()
    sequence_parallel: int | None = None
    recompute: str | None = None
    recompute_layers: int | None = None

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_LEVELS:
            raise ValueError(f"Hints(recompute={self.recompute!r}): one of "
                             f"{', '.join(map(repr, RECOMPUTE_LEVELS))}")
        if self.recompute_layers is not None and (
                self.recompute not in ("full", "selective") or int(self.recompute_layers) != self.recompute_layers
                or self.recompute_layers < 1):
            raise ValueError(f"Hints(recompute_layers={self.recompute_layers!r}): a count of layers >= 1, with "
                             f"recompute='full' or 'selective' (it is {self.recompute!r})")


COLUMN = r"(q_proj|k_proj|v_proj|fc1|gate_proj|up_proj|lm_head)$"
ROW = r"(o_proj|fc2|down_proj)$"
EMBEDDING = r"(embed|wte)\.weight$"


def _tensor_parallel(dp: int | None, tp: int | None):
    """Strategy predicates of Megatron's TP+SP linears with the batch split over ``dp``
    (either axis may be absent)."""
    def batch_split(s):
        return dp is None or s.ins[0][dp] == "S0"

    def col(s):
        return s.kind == "spatial" and (tp is None or s.ins[1][tp] == "S0") and batch_split(s)

    def row(s):
        return s.kind == "spatial" and (tp is None or s.ins[1][tp] == "S1") and batch_split(s)

    def not_temporal(s):
        return s.kind == "spatial" or s.kind == "replicate-fallback"

    return [(COLUMN, col), (ROW, row), (r".", not_temporal)]


def _vocab_parallel(tp: int | None):
    return (EMBEDDING, lambda p: tp is None or p[tp] in ("S0", "R"))


def megatron(mesh_shape: tuple[int, ...], dp_axis: int | None = None, tp_axis: int | None = None,
             distributed_optimizer: bool = False, sequence_parallel: bool = False) -> Hints:
    """Megatron-LM on ``mesh_shape``: TP+SP on ``tp_axis``, data parallelism on ``dp_axis``
    (None: absent). With neither given: TP on the last axis, DP on the first of two.
    ``sequence_parallel``: the glue between the linears sequence-split on the TP axis
    always (``Hints.sequence_parallel``), as ``--sequence-parallel`` runs it; by default
    the solver decides.

    ``distributed_optimizer``: Megatron's distributed optimizer over the DP axis. Megatron
    reduce-scatters the gradients, steps its 1/dp of the optimizer state and all-gathers the
    updated weights (ZeRO-1: the traffic of DP's all-reduce). stpc runs it as ZeRO-2: each
    weight, its gradient and its optimizer state stored 1/dp per rank, the weight gathered
    once per step (in forward, prefetched) and kept for backward, its gradient
    reduce-scattered (``Hints.keep_gathered``): the same traffic, and no more memory than
    Megatron's (which keeps whole weights and gradient buffers)."""
    if dp_axis is None and tp_axis is None:
        tp_axis = len(mesh_shape) - 1
        dp_axis = 0 if len(mesh_shape) > 1 else None
    dp, tp = dp_axis, tp_axis
    zero = distributed_optimizer and dp is not None

    def weight(p):  # parameters: never ZeRO/grid-sharded on the data axis
        return dp is None or p[dp] == "R"

    return Hints(force=_tensor_parallel(dp, tp), param_force=[(r".", _zero_sharded(dp, tp) if zero else weight),
                                                              _vocab_parallel(tp)],
                 temporal=False, name="megatron", keep_gathered=(dp,) if zero else (),
                 sequence_parallel=tp if sequence_parallel else None)


def _zero_sharded(dp: int, tp: int | None):
    """Parameters stored sharded over the DP axis (ZeRO-2/3). A dim TP does not split when DP
    is the outer axis: the runtime nests splits outer axis first, so a dim split on both
    would be gathered whole over both axes and sliced back for TP (TorchTitan's strided
    sharding avoids that; here the other dim does, at the same bytes). A parameter with no
    other dim falls back (a hint that leaves nothing keeps every choice)."""
    def sharded(p):
        return p[dp][0] == "S" and not (tp is not None and dp < tp and p[tp] == p[dp])
    return sharded


def fsdp_tp(mesh_shape: tuple[int, ...], dp_axis: int, tp_axis: int | None = None,
            sequence_parallel: bool = False) -> Hints:
    """TorchTitan's FSDP (ZeRO-3) over ``dp_axis`` with TP+SP on ``tp_axis`` (None: FSDP
    alone). A parameter no dim of which divides over the DP axis stays whole there.
    ``sequence_parallel`` as in :func:`megatron`."""
    dp, tp = dp_axis, tp_axis
    sharded = _zero_sharded(dp, tp)

    return Hints(force=_tensor_parallel(dp, tp), param_force=[(r".", sharded), _vocab_parallel(tp)],
                 temporal=False, name="fsdp-tp", sequence_parallel=tp if sequence_parallel else None)


# ops that are not glue: the linears, attention and the embedding, split by TP's own rule
# (the vocab-parallel embedding's partial output is reduce-scattered onto sequence shards
# by the glue that reads it), and the loss
_NOT_GLUE = ("linear", "mm", "addmm", "bmm", "matmul", "scaled_dot_product_attention", "embedding",
             "cross_entropy_loss")


def sequence_parallel_nodes(graph) -> set[str]:
    """Names of the ops sequence parallelism splits on the sequence: every op whose output
    is a [batch, sequence, width] activation of the model's width (the last dim of the
    token embedding's output), other than a linear, attention, the embedding or the loss:
    the residual adds and the norms. Empty for a graph without a token embedding."""
    def act(n):
        val = n.meta.get("val") if n.op == "call_function" else None
        return val if val is not None and hasattr(val, "dim") and val.dim() == 3 and val.is_floating_point() else None

    op = {n: getattr(n.target, "__name__", "").split(".")[0] for n in graph.nodes if n.op == "call_function"}
    width = next((act(n).shape[-1] for n in op if op[n] == "embedding" and act(n) is not None), None)
    if width is None:
        return set()
    return {n.name for n in op if act(n) is not None and act(n).shape[-1] == width and op[n] not in _NOT_GLUE}


TOKEN_EMBEDDING = r"^(wte|embed|embed_tokens|model\.embed_tokens|transformer\.wte)$"  # module paths (zoo, HF)


def data_parallel(mesh_shape: tuple[int, ...]) -> Hints:
    """Pure data parallelism (DDP): every linear's input and the token embedding's ids split
    on their batch on every axis, weights replicated. (Without the batch split, a small model
    is planned whole on every rank, where at that size latency beats any collective: not
    what DDP runs.)"""
    return Hints(force=[(r".", lambda s: s.kind == "spatial"),
                        (r"^linear", lambda s: all(t == "S0" for t in s.ins[0])),
                        (TOKEN_EMBEDDING, lambda s: all(t == "S0" for t in s.ins[1]))],
                 param_force=[(r".", lambda p: all(t == "R" for t in p))], temporal=False, name="dp")


def spatial(mesh_shape: tuple[int, ...]) -> Hints:
    """stpc's own search with the spatial-temporal families off (Alpa-like)."""
    return Hints(temporal=False, name="spatial")


PRESETS = {"megatron": megatron, "dp": data_parallel, "spatial": spatial,
           "fsdp-tp": lambda shape: fsdp_tp(shape, 0, 1 if len(shape) > 1 else None)}


def preset(name: str, mesh_shape: tuple[int, ...]) -> Hints:
    """The hints of preset ``name`` on one mesh shape (its default axes). ``search`` runs the
    ``megatron`` and ``fsdp-tp`` presets over their whole layout space instead
    (``stpc.planner.baselines``)."""
    try:
        return PRESETS[name](mesh_shape)
    except KeyError:
        raise ValueError(f"unknown hints preset {name!r}; known: {', '.join(PRESETS)}") from None
