"""Closed-form per-device training memory of the zoo's GPT and Llama configs under
data (dp) x tensor (tp) x sequence (sp) parallelism, kept symbolic with sympy so a
notebook can print the formula and substitute numbers. A cross-check of the planner's
memory model (:class:`memory.MemoryModel`), not a second engine: its bytes per parameter
are the model's (``memory.bytes_per_param``), and ``tests/test_planner.py`` holds a
plan's parameter state against it.

Activations saved per transformer layer, in elements of the activation dtype, with
flash attention (SDPA: no s x s score matrix is kept), no dropout and no recompute, for
s tokens per sequence, b sequences per data-parallel rank, hidden size h, a heads, k
key/value heads, ffn width f:

    Llama (RMSNorm, RoPE, SwiGLU):  s b h (6 + 2 k/a + 4 f/h)
        the 4D memory-estimator paper's  s b h (12 + 4k/a + 8 f/h)  bytes in bf16:
        norm input, norm output, Q, K, V, attention output; norm input and output,
        gate, up, silu(gate), silu*up.
    GPT (LayerNorm, GELU MLP):      s b h (8 + 2 f/h)
        ln1 in/out, Q, K, V, attention output, ln2 in/out, fc1 out, gelu out
        (Megatron's 34 s b h bf16 bytes less its two dropout masks, flash attention).

plus the loss head's fp32 logits, 4 s b V bytes. With Megatron sequence parallelism
inside the tensor-parallel group and sp-way sequence (context) parallelism, all of it
divides by tp*sp. Parameters divide by tp (vocab-parallel embedding; norms replicated
counted as divided, a negligible error); weights, grads and optimizer state take the
``memory.LAYOUTS`` bytes per parameter, the optimizer part divided by dp with
``zero=True`` (Megatron's distributed optimizer: 6 + 12/dp B/param).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp_

from .memory import bytes_per_param

# The symbols, exported so notebooks can build their own substitutions.
V, h, L, a, k, f, P = sp_.symbols("V h L a k f P_pos", positive=True)
s, b, dp, tp, sp = sp_.symbols("s b dp tp sp", positive=True)
e_act = sp_.Symbol("e_act", positive=True)  # bytes per activation element
w_b, g_b, o_b = sp_.symbols("w_B g_B o_B", positive=True)  # bytes per param: weight, grad, optimizer

_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ClosedForm:
    """``expr``: total bytes per device (sympy); ``terms``: its parts (params, grads,
    optimizer, activations); ``subs``: the numbers for every symbol; ``value`` and
    ``values``: the numeric evaluation, bytes."""

    expr: sp_.Expr
    terms: dict
    subs: dict
    value: float
    values: dict


def param_count_expr(cfg) -> sp_.Expr:
    """Symbolic parameter count of a zoo config (matches ``stpc.frontend.models.num_params``)."""
    if getattr(cfg, "family", "") == "llama":
        layer = h * h + 2 * h * (k * h / a) + h * h + 3 * h * f + 2 * h
        return V * h * (1 if cfg.tied_head else 2) + L * layer + h
    bias = 1 if cfg.bias else 0
    layer = 4 * h * h + 4 * h * bias + 2 * h * f + (f + h) * bias + 4 * h
    total = V * h * (1 if cfg.tied_head else 2) + L * layer + 2 * h
    if cfg.position == "learned":
        total += P * h
    if cfg.embed_norm:
        total += 2 * h
    return total


def activation_expr(cfg) -> sp_.Expr:
    """Symbolic activation bytes per device (all layers plus the loss head's logits)."""
    if getattr(cfg, "family", "") == "llama":
        per_layer = s * b * h * (6 + 2 * k / a + 4 * f / h)
    else:
        per_layer = s * b * h * (8 + 2 * f / h)
    return (L * per_layer * e_act + 4 * s * b * V) / (tp * sp)


def closed_form_memory(cfg, seq: int, batch: int, dp: int = 1, tp: int = 1, sp: int = 1,
                       dtype: str = "bf16", layout: str = "mixed-adam", zero: bool = False) -> ClosedForm:
    """Per-device training memory of ``cfg`` for a global ``batch`` of sequences of
    ``seq`` tokens on dp x tp x sp devices. ``dtype`` is the activation dtype."""
    if batch % dp:
        raise ValueError(f"global batch {batch} is not divisible by dp={dp}")
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {dtype!r}")
    wB, gB, oB = bytes_per_param(layout)
    n_local = param_count_expr(cfg) / tp
    terms = {
        "params": n_local * w_b,
        "grads": n_local * g_b,
        "optimizer": n_local * o_b / (dp if zero else 1),
        "activations": activation_expr(cfg),
    }
    expr = sum(terms.values())
    subs = {V: cfg.vocab, h: cfg.d_model, L: cfg.n_layers, a: cfg.n_heads,
            k: getattr(cfg, "n_kv_heads", cfg.n_heads), f: cfg.ffn,
            P: cfg.max_seq if getattr(cfg, "position", "") == "learned" else 0,
            s: seq, b: batch // dp, globals()["dp"]: dp, globals()["tp"]: tp, globals()["sp"]: sp,
            e_act: _ITEMSIZE[dtype], w_b: wB, g_b: gB, o_b: oB}
    values = {name: float(t.subs(subs)) for name, t in terms.items()}
    return ClosedForm(expr=expr, terms=terms, subs=subs, value=float(expr.subs(subs)), values=values)
