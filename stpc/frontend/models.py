"""The model zoo: a GPT family (GPT-2, OPT, BLOOM shapes) and a Llama family.

Both are plain ``nn.Module`` s written the way users write them, so the tracer
sees what it will see in the wild: ``nn.Linear``, ``F.scaled_dot_product_attention``,
norms, embeddings, and ``F.cross_entropy`` when targets are given.

Build any config on the ``meta`` device to plan without allocating weights::

    with torch.device("meta"):
        model = build("llama2-70b")
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """GPT-style decoder: LayerNorm, GELU/ReLU MLP, multi-head attention.

    ``position`` is ``"learned"`` (GPT-2, OPT) or ``"alibi"`` (BLOOM: a
    per-head linear bias added to the attention scores, no position table).
    """

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn: int
    max_seq: int = 2048
    position: str = "learned"
    activation: str = "gelu"
    tied_head: bool = True
    bias: bool = True
    embed_norm: bool = False  # BLOOM's LayerNorm right after the embedding
    family: str = "gpt"


@dataclass(frozen=True)
class LlamaConfig:
    """Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    max_seq: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_head: bool = False
    family: str = "llama"


CONFIGS: dict[str, GPTConfig | LlamaConfig] = {
    "gpt-tiny": GPTConfig(vocab=128, d_model=32, n_layers=2, n_heads=4, ffn=128, max_seq=64),
    "gpt-50m": GPTConfig(vocab=8192, d_model=512, n_layers=12, n_heads=8, ffn=2048, max_seq=512),
    "gpt2-small": GPTConfig(vocab=50257, d_model=768, n_layers=12, n_heads=12, ffn=3072, max_seq=1024),
    "opt-6.7b": GPTConfig(vocab=50272, d_model=4096, n_layers=32, n_heads=32, ffn=16384,
                          activation="relu"),
    "opt-175b": GPTConfig(vocab=50272, d_model=12288, n_layers=96, n_heads=96, ffn=49152,
                          activation="relu"),
    "bloom-7b1": GPTConfig(vocab=250880, d_model=4096, n_layers=30, n_heads=32, ffn=16384,
                           position="alibi", embed_norm=True),
    "bloom-176b": GPTConfig(vocab=250880, d_model=14336, n_layers=70, n_heads=112, ffn=57344,
                            position="alibi", embed_norm=True),
    "llama-tiny": LlamaConfig(vocab=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=96,
                              max_seq=64),
    "llama2-7b": LlamaConfig(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                             ffn=11008),
    "llama2-70b": LlamaConfig(vocab=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              ffn=28672),
    "llama3-8b": LlamaConfig(vocab=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn=14336, max_seq=8192, rope_theta=500000.0),
}

# Published parameter counts, for the zoo's own test (source: the model cards / papers).
PUBLISHED_PARAMS = {
    "gpt2-small": 124.4e6,
    "opt-6.7b": 6.66e9,
    "opt-175b": 175.0e9,
    "bloom-7b1": 7.07e9,
    "bloom-176b": 176.2e9,
    "llama2-7b": 6.74e9,
    "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9,
}


def get_config(name: str) -> GPTConfig | LlamaConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(CONFIGS))}") from None


# ----------------------------------------------------------------------------- GPT


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al.), including the non-power-of-two rule."""
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return pow2(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return pow2(closest) + pow2(2 * closest)[0::2][: n_heads - closest]


def alibi_slopes_tensor(n_heads: int, device, dtype) -> torch.Tensor:
    """:func:`alibi_slopes` computed with torch ops (no tensor constant in the graph)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    i = torch.arange(1, closest + 1, device=device, dtype=torch.float32)
    s = torch.pow(2.0, -8.0 * i / closest)
    if closest < n_heads:
        j = torch.arange(0, n_heads - closest, device=device, dtype=torch.float32)
        s = torch.cat([s, torch.pow(2.0, -8.0 * (2 * j + 1) / (2 * closest))])
    return s.to(dtype)


class GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.alibi = cfg.position == "alibi"
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x):
        b, s, d = x.shape
        h = self.n_heads
        q = self.q_proj(x).view(b, s, h, d // h).transpose(1, 2)
        k = self.k_proj(x).view(b, s, h, d // h).transpose(1, 2)
        v = self.v_proj(x).view(b, s, h, d // h).transpose(1, 2)
        if self.alibi:
            pos = torch.arange(s, device=x.device, dtype=x.dtype)
            slopes = alibi_slopes_tensor(h, x.device, x.dtype)
            dist = pos[None, :] - pos[:, None]  # j - i, <= 0 below the diagonal
            causal = torch.ones(s, s, device=x.device, dtype=torch.bool).tril()
            bias = (slopes[:, None, None] * dist).masked_fill(~causal, float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.ffn, cfg.d_model, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh") if cfg.activation == "gelu" else nn.ReLU()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = GPTAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = GPTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.d_model) if cfg.position == "learned" else None
        self.ln_emb = nn.LayerNorm(cfg.d_model) if cfg.embed_norm else None
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tied_head:
            self.lm_head.weight = self.wte.weight
        _init_weights(self)

    def init_weights(self) -> None:
        """(Re-)initialise every parameter in place, e.g. after ``to_empty``."""
        _init_weights(self)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        if self.ln_emb is not None:
            x = self.ln_emb(x)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x))
        return _maybe_loss(logits, targets)


# ----------------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, theta: float):
    """Rotary embedding on [b, h, s, hd], rotate-half convention, computed in place of a buffer
    so meta-device tracing needs no real table."""
    s, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
        self.n_heads, self.n_kv, self.theta = cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h, kv = self.n_heads, self.n_kv
        hd = d // h
        q = rope(self.q_proj(x).view(b, s, h, hd).transpose(1, 2), self.theta)
        k = rope(self.k_proj(x).view(b, s, kv, hd).transpose(1, 2), self.theta)
        v = self.v_proj(x).view(b, s, kv, hd).transpose(1, 2)
        if kv != h:
            k = k.repeat_interleave(h // kv, dim=1)
            v = v.repeat_interleave(h // kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tied_head:
            self.lm_head.weight = self.embed.weight
        _init_weights(self)

    def init_weights(self) -> None:
        """(Re-)initialise every parameter in place, e.g. after ``to_empty``."""
        _init_weights(self)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return _maybe_loss(self.lm_head(self.norm(x)), targets)


# ----------------------------------------------------------------------------- shared


def _maybe_loss(logits, targets):
    if targets is None:
        return logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _init_weights(model: nn.Module) -> None:
    """GPT-2 style init (N(0, 0.02)), norms at one; a no-op on meta tensors, which hold no
    data. It works on DTensor parameters too: a model built on ``meta``, compiled, then
    ``to_empty(device=...)`` is initialised shard by shard with ``model.init_weights()``."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and not m.weight.is_meta:
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, RMSNorm)) and not m.weight.is_meta:
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)


def build(name_or_cfg, **overrides) -> nn.Module:
    """Build a zoo model by config name (or config object) on the current default device."""
    cfg = get_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    if overrides:
        cfg = replace(cfg, **overrides)
    return Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)


def example_inputs(cfg_or_name, batch: int, seq: int, device="meta", targets: bool = True):
    """Token ids (and targets) of the right shape; random ints on real devices."""
    cfg = get_config(cfg_or_name) if isinstance(cfg_or_name, str) else cfg_or_name
    if seq > cfg.max_seq and isinstance(cfg, GPTConfig) and cfg.position == "learned":
        raise ValueError(f"seq={seq} exceeds the learned position table ({cfg.max_seq})")
    make = (lambda: torch.empty(batch, seq, dtype=torch.long, device=device)) if str(device) == "meta" \
        else (lambda: torch.randint(0, cfg.vocab, (batch, seq), device=device))
    return (make(), make()) if targets else (make(),)


def num_params(model: nn.Module) -> int:
    """Unique parameters (a tied head counts once)."""
    return sum(p.numel() for p in model.parameters())
