"""bench_engines: PyTorch's own distributed engines on a zoo model, the torch side of the benchmark.

In: a plain single-device zoo model (``stpc.frontend.models``: the GPT or the Llama family), the
global batch and a mesh shape, on ranks whose process group the caller has initialised.
Out: an :class:`Engine`, the model parallelised by torch's own machinery the way a TorchTitan /
Megatron user writes it, with one ``forward_backward`` per training step. Nothing of stpc's
planner or runtime is involved: this is the baseline stpc is measured against.

Every engine yields the gradients of the *global* mean loss (an optimizer step on
``engine.parameters()`` equals one single-device step up to fp32 rounding), and each is set up
with its own best practice, so the comparison is with torch at its best, not a strawman:

``ddp`` (mesh ``(N,)``)
    ``torch.nn.parallel.DistributedDataParallel`` over all ranks with its defaults (25 MiB
    gradient buckets, all-reduces overlapped with backward). Each rank runs ``B/N`` rows;
    DDP averages the gradients, which is the gradient of the global mean loss.

``tp`` (mesh ``(N,)``)
    Megatron-style tensor parallelism with sequence parallelism, written exactly as
    TorchTitan's ``apply_tp`` writes it with ``torch.distributed.tensor.parallel``:
    ``ColwiseParallel`` on q/k/v and fc1 (gate/up), ``RowwiseParallel(output_layouts=Shard(1))``
    on o_proj and fc2 (down), ``SequenceParallel`` on every norm, ``PrepareModuleInput``
    (``Shard(1)`` -> ``Replicate()``: the SP all-gather) in front of attention and MLP, the
    token embedding ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``
    (vocab-sharded table, reduce-scatter onto sequence shards), the head
    ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)``
    and ``loss_parallel()`` around the loss and its backward, so the ``[B, S, V]`` logits are
    never gathered. Every TP rank sees the whole batch. Three things of the zoo need care:

    * Attention with local heads. The zoo's attention reshapes with the global head count; a TP
      user writes it with local heads, so each attention module gets ``n_heads // N`` (and
      ``n_kv_heads // N``) and a bound forward that views with the local sizes (ALiBi slopes
      are sliced to the rank's heads). SDPA then runs on plain local tensors.
    * The learned position table (GPT's ``wpe``), which TorchTitan's Llama does not have. It is
      kept replicated (a ``Replicate()`` DTensor, as SP keeps norm weights) and each rank looks
      up only the positions of its own sequence shard (``arange(S)`` sliced to ``Shard(0)``,
      no communication), which adds straight onto the embedding's ``Shard(1)`` output; its
      gradient is reduced like a norm weight's. This is cheaper than Megatron's own recipe for
      learned positions (all-reduce the word embedding, add positions, then scatter).
    * The tied head (GPT: ``lm_head.weight is wte.weight``) stays one parameter: the vocab-
      sharded embedding (``RowwiseParallel``) and the column-parallel head both place the
      ``[V, D]`` table as ``Shard(0)``, so after ``parallelize_module`` the head's weight is
      re-pointed at the embedding's DTensor and both uses accumulate into one gradient.

    The replicated parameters of SP (norm weights and biases, the position table) get
    ``Partial`` gradients from the sequence shards; DTensor leaves them so and would all-reduce
    each inside the optimizer, once per op reading it. Like Megatron (``finalize_model_grads``)
    the engine all-reduces them after backward in one coalesced all-reduce. (Under ``fsdp-tp``
    FSDP2 already turns them into ``Replicate`` before its reduce-scatter, per parameter.)

``fsdp`` (mesh ``(N,)``)
    FSDP2: ``torch.distributed.fsdp.fully_shard`` on every transformer block, then on the root
    (which then owns embeddings, final norm and the tied head), all with the defaults:
    ``reshard_after_forward`` (``True`` for blocks, ``False`` for the root), the implicit
    forward/backward prefetch of the next block's all-gather, fp32 everywhere. Each rank runs
    ``B/N`` rows; the gradient reduce-scatter averages over ranks.

``fsdp-tp`` (mesh ``(dp, tp)``)
    TorchTitan's 2-D composition: the ``tp`` engine's plan on the ``tp`` sub-mesh, then
    ``fully_shard`` over the ``dp`` sub-mesh (blocks, then root). The ``tp`` ranks of one data
    parallel group see the same ``B/dp`` rows.

The loss ``forward_backward`` returns is averaged over the data-parallel ranks (one scalar
all-reduce, the same for every engine); it is what the single-device model would print.
"""
from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from stpc.frontend.models import GPT, Llama, alibi_slopes_tensor, rope

ENGINES = ("ddp", "tp", "fsdp", "fsdp-tp")

__all__ = ["ENGINES", "Engine", "build_engine", "apply_tp", "apply_fsdp"]


class Engine:
    """One parallelised model on this rank, with this rank's share of the global batch.

    ``forward_backward()`` runs one forward and backward (gradients accumulate into the
    parameters' ``.grad``, as ``loss.backward()`` does) and returns the detached global mean
    loss; ``parameters()`` is what the optimizer steps.
    """

    def __init__(self, name: str, layout: str, model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor,
                 loss_parallel_: bool = False, dp_group=None, dp_size: int = 1):
        self.name, self.layout, self.model = name, layout, model
        self.idx, self.tgt = idx, tgt
        self._loss_parallel = loss_parallel_
        self._dp_group, self._dp_size = dp_group, dp_size

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        """FQNs as on the single-device model (DDP's ``module.`` prefix removed)."""
        inner = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        return inner.named_parameters()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """FQN -> full value of every parameter, gathered (a collective: call it on every rank)."""
        return {k: (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
                for k, p in self.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """FQN -> full gradient of every parameter (zeros where none), gathered (a collective)."""
        out = {}
        for k, p in self.named_parameters():
            g = p.grad
            if g is None:
                out[k] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            else:
                out[k] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        return out

    def forward_backward(self) -> torch.Tensor:
        if self._loss_parallel:
            with loss_parallel():  # the loss and its backward on vocab-sharded logits
                loss = self.model(self.idx, self.tgt)
                loss.backward()
            _reduce_partial_grads(self.model.parameters())
        else:
            loss = self.model(self.idx, self.tgt)
            loss.backward()
        loss = loss.detach()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()  # replicated over the TP ranks: no communication
        if self._dp_size > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=self._dp_group)  # gloo has no AVG: sum, then divide
            loss /= self._dp_size
        return loss

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, {self.layout!r})"


def _reduce_partial_grads(params) -> None:
    """Turn the ``Partial`` gradients TP leaves on replicated parameters (the SP norms, the
    position table) into ``Replicate`` ones with one coalesced all-reduce per mesh,
    as Megatron's ``finalize_model_grads`` does for sequence-parallel norms. Left alone, DTensor
    would all-reduce each of them inside the optimizer, once per op that reads the gradient."""
    pending: dict[int, list] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            pending.setdefault(id(g.device_mesh), []).append(p)
    for ps in pending.values():
        mesh = ps[0].grad.device_mesh
        if mesh.ndim != 1 or any(p.grad.placements[0].reduce_op != "sum" for p in ps):
            for p in ps:  # not the plain TP case: let DTensor do it, one parameter at a time
                p.grad = p.grad.redistribute(mesh, [Replicate() if pl.is_partial() else pl
                                                    for pl in p.grad.placements])
            continue
        local = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in local])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, t, part in zip(ps, local, flat.split([t.numel() for t in local])):
            p.grad = DTensor.from_local(part.view(t.shape), mesh, [Replicate()], run_check=False)


# ----------------------------------------------------------------------------- model anatomy


def _anatomy(model: nn.Module) -> dict:
    """Submodule names of the zoo family: embedding, block norms, projections, final norm."""
    if isinstance(model, GPT):
        return {"embed": "wte", "norms": ("ln1", "ln2"), "col": ("attn.q_proj", "attn.k_proj", "attn.v_proj",
                "mlp.fc1"), "row": ("attn.o_proj", "mlp.fc2"), "norm": "ln_f"}
    if isinstance(model, Llama):
        return {"embed": "embed", "norms": ("attn_norm", "mlp_norm"), "col": ("attn.q_proj", "attn.k_proj",
                "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"), "row": ("attn.o_proj", "mlp.down_proj"),
                "norm": "norm"}
    raise TypeError(f"bench_engines: a zoo GPT or Llama model is needed, got {type(model).__name__}")


# ----------------------------------------------------------------------------- attention with local heads


def _gpt_attention_local(self, x):
    """GPTAttention.forward with this rank's heads: q/k/v come out column-sharded."""
    b, s = x.shape[0], x.shape[1]
    h = self.n_heads  # local
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    hd = q.shape[-1] // h
    q, k, v = (t.view(b, s, h, hd).transpose(1, 2) for t in (q, k, v))
    if self.alibi:
        pos = torch.arange(s, device=q.device, dtype=q.dtype)
        slopes = alibi_slopes_tensor(self.tp_heads_total, q.device, q.dtype)[self.tp_head0: self.tp_head0 + h]
        dist_ = pos[None, :] - pos[:, None]
        causal = torch.ones(s, s, device=q.device, dtype=torch.bool).tril()
        bias = (slopes[:, None, None] * dist_).masked_fill(~causal, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(y.transpose(1, 2).reshape(b, s, h * hd))


def _llama_attention_local(self, x):
    """LlamaAttention.forward with this rank's query and key/value heads (GQA kept per rank)."""
    b, s = x.shape[0], x.shape[1]
    h, kv = self.n_heads, self.n_kv  # local
    q = self.q_proj(x)
    hd = q.shape[-1] // h
    q = rope(q.view(b, s, h, hd).transpose(1, 2), self.theta)
    k = rope(self.k_proj(x).view(b, s, kv, hd).transpose(1, 2), self.theta)
    v = self.v_proj(x).view(b, s, kv, hd).transpose(1, 2)
    if kv != h:
        k = k.repeat_interleave(h // kv, dim=1)
        v = v.repeat_interleave(h // kv, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(y.transpose(1, 2).reshape(b, s, h * hd))


def _localise_attention(model: nn.Module, tp: int, tp_rank: int) -> None:
    for layer in model.layers:
        attn = layer.attn
        if isinstance(model, GPT):
            attn.tp_heads_total, attn.n_heads = attn.n_heads, attn.n_heads // tp
            attn.tp_head0 = tp_rank * attn.n_heads
            attn.forward = types.MethodType(_gpt_attention_local, attn)
        else:
            attn.n_heads, attn.n_kv = attn.n_heads // tp, attn.n_kv // tp
            attn.forward = types.MethodType(_llama_attention_local, attn)


# ----------------------------------------------------------------------------- TP (+SP), TorchTitan's apply_tp


def _positions_in(module, inputs, mesh):
    """wpe's input ``arange(S)`` (the same on every TP rank) -> this rank's sequence shard."""
    (pos,) = inputs
    return DTensor.from_local(pos, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)])


def _positions_out(module, outputs, mesh):
    return outputs.to_local()  # [S/tp, D]: adds onto the embedding's local [b, S/tp, D]


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, seq: int) -> nn.Module:
    """Tensor + sequence parallelism on ``tp_mesh`` in place, TorchTitan's ``apply_tp`` (with loss
    parallel) on the zoo's module names; ``forward`` must then run under ``loss_parallel()``."""
    names = _anatomy(model)
    tp = tp_mesh.size()
    if seq % tp:
        raise ValueError(f"sequence parallelism needs seq ({seq}) divisible by tp ({tp})")
    cfg = model.cfg
    heads = (("n_heads", cfg.n_heads),) + ((("n_kv_heads", cfg.n_kv_heads),) if isinstance(model, Llama) else ())
    for what, n in (("vocab", cfg.vocab), ("ffn", cfg.ffn), ("d_model", cfg.d_model)) + heads:
        if n % tp:
            raise ValueError(f"tp {tp} does not divide {what} ({n}); TorchTitan and Megatron need it to")
    tied = model.lm_head.weight is getattr(model, names["embed"]).weight
    top = {
        names["embed"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        names["norm"]: SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    if getattr(model, "ln_emb", None) is not None:  # BLOOM's embedding norm, on sequence shards
        top["ln_emb"] = SequenceParallel(use_local_output=True)
    parallelize_module(model, tp_mesh, top)
    if getattr(model, "wpe", None) is not None:
        distribute_module(model.wpe, tp_mesh, input_fn=_positions_in, output_fn=_positions_out)
    if tied:  # both Shard(0) on [V, D]: one parameter, as on one device
        model.lm_head.weight = getattr(model, names["embed"]).weight
    n1, n2 = names["norms"]
    for block in model.layers:
        plan = {n1: SequenceParallel(), n2: SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
        plan.update({n: ColwiseParallel() for n in names["col"]})
        plan.update({n: RowwiseParallel(output_layouts=Shard(1)) for n in names["row"]})
        parallelize_module(block, tp_mesh, plan)
    _localise_attention(model, tp, tp_mesh.get_local_rank())
    return model


# ----------------------------------------------------------------------------- FSDP2


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """FSDP2 in place with the defaults: each block its own group, the root owns the rest."""
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


# ----------------------------------------------------------------------------- the engines


def _rows(x: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    if x.shape[0] % parts:
        raise ValueError(f"global batch {x.shape[0]} is not divisible by {parts} data-parallel ranks")
    n = x.shape[0] // parts
    return x[part * n:(part + 1) * n].contiguous()


def build_engine(name: str, model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor,
                 mesh_shape: tuple[int, ...]) -> Engine:
    """Parallelise ``model`` (in place) with torch's engine ``name`` over ``mesh_shape`` ranks.

    ``idx``/``tgt`` are the global batch, the same on every rank; the engine keeps the rows
    this rank computes. The default process group must span ``prod(mesh_shape)`` ranks.
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    mesh_shape = tuple(int(n) for n in mesh_shape)
    world = dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise ValueError(f"mesh {mesh_shape} needs {math.prod(mesh_shape)} ranks, the group has {world}")
    if (len(mesh_shape) != 2) if name == "fsdp-tp" else (len(mesh_shape) != 1):
        raise ValueError(f"engine {name!r} takes a {'2' if name == 'fsdp-tp' else '1'}-D mesh, got {mesh_shape}")
    _anatomy(model)
    rank, seq = dist.get_rank(), idx.shape[1]
    if name == "ddp":
        n = mesh_shape[0]
        ddp = DistributedDataParallel(model)  # defaults: 25 MiB buckets, overlapped all-reduce
        return Engine(name, f"dp {n}", ddp, _rows(idx, rank, n), _rows(tgt, rank, n),
                      dp_group=None, dp_size=n)
    if name == "fsdp":
        n = mesh_shape[0]
        mesh = init_device_mesh(idx.device.type, mesh_shape, mesh_dim_names=("dp",))
        apply_fsdp(model, mesh)
        return Engine(name, f"fsdp {n}", model, _rows(idx, rank, n), _rows(tgt, rank, n),
                      dp_group=mesh.get_group(), dp_size=n)
    if name == "tp":
        n = mesh_shape[0]
        mesh = init_device_mesh(idx.device.type, mesh_shape, mesh_dim_names=("tp",))
        apply_tp(model, mesh, seq)
        return Engine(name, f"tp {n} (+SP)", model, idx.contiguous(), tgt.contiguous(), loss_parallel_=True)
    dp, tp = mesh_shape
    mesh = init_device_mesh(idx.device.type, mesh_shape, mesh_dim_names=("dp", "tp"))
    apply_tp(model, mesh["tp"], seq)
    apply_fsdp(model, mesh["dp"])
    part = mesh.get_coordinate()[0]
    return Engine(name, f"fsdp {dp} x tp {tp} (+SP)", model, _rows(idx, part, dp), _rows(tgt, part, dp),
                  loss_parallel_=True, dp_group=mesh["dp"].get_group(), dp_size=dp)
