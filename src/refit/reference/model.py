"""A tiny decoder-only transformer with HF (Llama) parameter names: the trainer's model in the demo
and tests, and the math the reference engine shares (RMSNorm, RoPE, attention) so that a refit that
landed gives the trainer's tokens and logits.

Layout of the trainer model (HF names, unfused):
  model.embed_tokens.weight                       [vocab, hidden]
  model.layers.{i}.input_layernorm.weight         [hidden]
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
  model.layers.{i}.post_attention_layernorm.weight
  model.layers.{i}.mlp.{gate,up,down}_proj.weight
  model.norm.weight, lm_head.weight
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_seq_len: int = 256
    # an auxiliary tensor `aux.weight` [1, hidden] of this dtype (None: no such tensor): what
    # real checkpoints carry beside the math (quantization scales, router biases, rotary buffers):
    # moved and checked like any weight, not used by the forward. Its one row means that a
    # sharded trainer has ranks that own none of it.
    aux_dtype: str | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)

    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel size that does not split this model evenly (ValueError)."""
        for what, n in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                        ("intermediate_size", self.intermediate_size), ("vocab_size", self.vocab_size)):  # fmt: skip
            if tp < 1 or n % tp:
                raise ValueError(f"tensor parallelism {tp} does not divide {what}={n}")

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainer (HF) parameter name and its shape, in state-dict order."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (h, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, h)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (self.vocab_size, h)
        if self.aux_dtype is not None:
            shapes["aux.weight"] = (1, h)
        return shapes

    def hf_dtypes(self) -> dict[str, str]:
        """Every trainer (HF) parameter name and its dtype name."""
        return {name: (self.aux_dtype or "float32") if name == "aux.weight" else "float32" for name in self.hf_shapes()}


def init_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic HF-named fp32 weights: the 'checkpoint' trainer and engines start from."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    dtypes = config.hf_dtypes()
    for name, shape in config.hf_shapes().items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[name] = out[name].to(getattr(torch, dtypes[name]))
    return out


# ---- math shared by the trainer model and the reference engine -------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on [B, heads, T, D] at absolute `positions` [T] (half-split layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], -1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """Causal attention. q [B,H,Tq,D] at positions q_offset.., k/v [B,KV,Tk,D] from position 0."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    qpos = torch.arange(q_offset, q_offset + tq)[:, None]
    kpos = torch.arange(tk)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ---- the trainer-side model ------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        kv = c.num_kv_heads * c.head_dim
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (b, t, _) = self.c, x.shape
        pos = torch.arange(t)
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        out = attention(q, k, v, 0).transpose(1, 2).reshape(b, t, c.hidden_size)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Aux(nn.Module):
    """The auxiliary tensor (see ModelConfig.aux_dtype)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, c.hidden_size, dtype=getattr(torch, c.aux_dtype or "float32")))


class _Backbone(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TinyLlama(nn.Module):
    """The trainer's model. `forward(ids [B,T]) -> logits [B,T,V]`."""

    def __init__(self, config: ModelConfig, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.aux_dtype is not None:
            self.aux = Aux(config)
        if seed is not None:
            self.load_state_dict(init_weights(config, seed))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


@torch.no_grad()
def greedy(model: TinyLlama, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy decoding by full recomputation (no cache): what an engine must match."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids]))[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


@torch.no_grad()
def prompt_logits(model: TinyLlama, prompt: list[int]) -> torch.Tensor:
    """Logits [T, V] for every position of `prompt`."""
    return model(torch.tensor([prompt]))[0]
