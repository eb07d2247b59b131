"""A tiny decoder-only transformer with HF (Llama / Qwen2) parameter names: the trainer's model in
the demo and tests, and the math the reference engine shares (RMSNorm, RoPE, attention) so that a
refit that landed gives the trainer's tokens and logits. The math follows `transformers`' Llama and
Qwen2 (eager attention) dtype for dtype: RMSNorm and softmax in float32, everything else in the
model's dtype.

Layout of the trainer model (HF names, unfused):
  model.embed_tokens.weight                       [vocab, hidden]
  model.layers.{i}.input_layernorm.weight         [hidden]
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   q: [heads * head_dim, hidden], o: [hidden, heads * head_dim]
  model.layers.{i}.self_attn.{q,k,v}_proj.bias    with `qkv_bias` (Qwen2; Llama's attention_bias)
  model.layers.{i}.self_attn.o_proj.bias          with `o_bias` (Llama's attention_bias)
  model.layers.{i}.post_attention_layernorm.weight
  model.layers.{i}.mlp.{gate,up,down}_proj.weight
  model.norm.weight, lm_head.weight               (no lm_head.weight of its own when tied)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = ("float32", "bfloat16", "float16")  # what the engine computes in
MODEL_TYPES = ("llama", "qwen2")  # the families ModelConfig.from_hf accepts
TIED_HEAD = {"lm_head.weight": "model.embed_tokens.weight"}  # alias -> the tensor it is (tie_word_embeddings)


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
    # model families (see from_hf); the defaults are the tiny Llama above
    head_dim: int | None = None  # None: hidden_size // num_heads (an explicit one may differ)
    qkv_bias: bool = False  # q/k/v_proj.bias (Qwen2 always; Llama with attention_bias)
    o_bias: bool = False  # o_proj.bias (Llama with attention_bias)
    tie_word_embeddings: bool = False  # the output head is the embedding: no lm_head.weight of its own
    dtype: str = "float32"  # every tensor's dtype but the auxiliary one
    model_type: str = "llama"  # a label: the flags above carry every difference the math sees

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: the reference engine computes in {list(DTYPES)}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r}: the reference engine hosts {list(MODEL_TYPES)}")

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        """The engine's config for a `transformers` LlamaConfig / Qwen2Config (duck-typed: anything
        with `to_dict()`) or a plain dict as in config.json. Refuses (ValueError naming the field)
        what this engine cannot compute exactly as `transformers` does, instead of serving wrong
        logits: another model_type, RoPE scaling, sliding windows, MLP biases, another activation,
        quantization, a dtype outside float32/bfloat16/float16."""
        d = _as_dict(config)
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r}: the reference engine hosts {list(MODEL_TYPES)} only")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r}: the reference engine's MLP is SiLU-gated")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True: the reference engine's MLP has no biases")
        if d.get("quantization_config"):
            raise ValueError("quantization_config: the reference engine hosts unquantized weights only")
        if model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True: the reference engine attends over the whole sequence")
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types {sorted(set(layer_types))}: the reference engine has full attention only")
        heads = _required(d, "num_attention_heads")
        hidden = _required(d, "hidden_size")
        biased = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=_required(d, "vocab_size"),
            hidden_size=hidden,
            num_layers=_required(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            intermediate_size=_required(d, "intermediate_size"),
            rope_theta=_rope_theta(d),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(d.get("max_position_embeddings") or (2048 if model_type == "llama" else 32768)),
            head_dim=int(d.get("head_dim") or hidden // heads),
            qkv_bias=True if model_type == "qwen2" else biased,  # Qwen2: always q/k/v bias, never o_proj's
            o_bias=False if model_type == "qwen2" else biased,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=_dtype_field(d),
            model_type=model_type,
        )

    @property
    def tied(self) -> dict[str, str]:
        """HF names that are another tensor (here: a tied head), alias -> that tensor."""
        return dict(TIED_HEAD) if self.tie_word_embeddings else {}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel size that does not split this model evenly (ValueError). Fewer
        KV heads than ranks are replicated, as SGLang and vLLM do (`kv_replicas`): TP must then be
        a multiple of num_kv_heads."""
        for what, n in (("num_heads", self.num_heads), ("intermediate_size", self.intermediate_size),
                        ("vocab_size", self.vocab_size)):  # fmt: skip
            if tp < 1 or n % tp:
                raise ValueError(f"tensor parallelism {tp} does not divide {what}={n}")
        kv = self.num_kv_heads
        if kv % tp if kv >= tp else tp % kv:
            raise ValueError(f"tensor parallelism {tp} neither divides nor is a multiple of num_kv_heads={kv}")

    def kv_replicas(self, tp: int) -> int:
        """How many TP ranks hold each KV head: 1 when there are at least as many KV heads as ranks,
        else tp // num_kv_heads (rank r holds KV head r // replicas; SGLang's and vLLM's
        layers/linear.py `QKVParallelLinear`: num_kv_head_replicas, shard_id = tp_rank // it)."""
        return 1 if self.num_kv_heads >= tp else tp // self.num_kv_heads

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainer (HF) parameter name and its shape, in state-dict order (a tied head, the
        embedding under another name, is not listed: see `tied`)."""
        assert self.head_dim is not None
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[p + f"self_attn.{proj}.weight"] = (rows, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{proj}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        if self.aux_dtype is not None:
            shapes["aux.weight"] = (1, h)
        return shapes

    def hf_dtypes(self) -> dict[str, str]:
        """Every trainer (HF) parameter name and its dtype name."""
        return {
            name: (self.aux_dtype or self.dtype) if name == "aux.weight" else self.dtype for name in self.hf_shapes()
        }


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(vars(config))


def _required(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    if value is None:
        raise ValueError(f"{key}: missing from the model config")
    return int(value)


def _rope_theta(d: Mapping[str, Any]) -> float:
    """RoPE base from `rope_theta` (transformers 4) or `rope_parameters` (5); anything but default
    RoPE on the whole head is refused, naming the field."""
    theta = d.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping) or any(isinstance(v, Mapping) for v in rope.values()):
            raise ValueError(f"{key}: {rope!r} is not one global RoPE setting (per-layer RoPE is not hosted)")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{key}: rope_type {kind!r} is not hosted (the reference engine computes default RoPE)")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{key}: partial_rotary_factor {rope['partial_rotary_factor']} is not hosted")
        theta = rope.get("rope_theta", theta)
    if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {d['partial_rotary_factor']} is not hosted")
    return float(theta if theta is not None else 10000.0)


def _dtype_field(d: Mapping[str, Any]) -> str:
    """`dtype` (transformers >= 4.56) or `torch_dtype`, as a torch.dtype or a name; absent: float32."""
    key = "dtype" if d.get("dtype") is not None else "torch_dtype"
    value = d.get(key)
    name = "float32" if value is None else str(value).removeprefix("torch.")
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(
        name, name
    )
    if name not in DTYPES:
        raise ValueError(f"{key} {value!r}: the reference engine computes in {list(DTYPES)}")
    return name


def init_weights(config: ModelConfig, seed: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Deterministic HF-named weights (in the config's dtypes): the 'checkpoint' trainer and
    engines start from. A tied head is not listed (it is the embedding). Drawn on `device` by
    that device's generator: the same seed gives other values on CUDA than on CPU."""
    return dict(iter_init_weights(config, seed, device))


def iter_init_weights(
    config: ModelConfig, seed: int, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """`init_weights` one tensor at a time, the same values: a consumer that keeps each where it
    goes and drops it holds one tensor's temporaries at a time, not a second copy of the model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtypes = config.hf_dtypes()
    for name, shape in config.hf_shapes().items():
        t = torch.randn(shape, generator=gen, device=device)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            yield name, (t.mul_(0.1).add_(1.0)).to(getattr(torch, dtypes[name]))
        else:
            yield name, t.div_(math.sqrt(shape[-1])).to(getattr(torch, dtypes[name]))
        del t


# ---- math shared by the trainer model and the reference engine -------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalized in float32, back to x's dtype, then scaled."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on [B, heads, T, D] at absolute `positions` [T] (or [B, T]: each row its
    own; half-split layout); the angles in float32, cos/sin cast to x's dtype."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    if positions.dim() == 2:  # [B, T, D] -> [B, 1, T, D]: the same angles for every head
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], -1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """Causal attention. q [B,H,Tq,D] at positions q_offset.., k/v [B,KV,Tk,D] from position 0.
    Scores scaled by D**-0.5, softmax in float32 (as transformers' eager attention)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    qpos = torch.arange(q_offset, q_offset + tq, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """One query per row: q [B,H,1,D] against k/v [B,KV,T,D], `masked` [B,T] true past a row's
    last position. Query head h reads KV head h // (H // KV) (as `attention`'s repeat), without
    copying K and V per head; scaled and softmaxed as `attention`."""
    b, h, _, d = q.shape
    kv = k.shape[1]
    scores = (q.reshape(b, kv, h // kv, d) @ k.transpose(-1, -2)) * d**-0.5  # [B, KV, G, T]
    scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v  # [B, KV, G, D]
    return out.reshape(b, h, 1, d)


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
        assert c.head_dim is not None
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=c.o_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (b, t, _) = self.c, x.shape
        assert c.head_dim is not None
        pos = torch.arange(t, device=x.device)
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        out = attention(q, k, v, 0).transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)
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
    """The trainer's model. `forward(ids [B,T]) -> logits [B,T,V]`. With `tie_word_embeddings`,
    `lm_head.weight` is the embedding's parameter (its state dict lists it twice, as HF's does)."""

    def __init__(self, config: ModelConfig, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.dtype != "float32":
            self.model.to(getattr(torch, config.dtype))
            self.lm_head.to(getattr(torch, config.dtype))
        if config.aux_dtype is not None:
            self.aux = Aux(config)
        if seed is not None:
            weights = init_weights(config, seed)
            for alias, target in config.tied.items():
                weights[alias] = weights[target]
            self.load_state_dict(weights)

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
        logits = model(torch.tensor([ids], device=model.lm_head.weight.device))[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


@torch.no_grad()
def prompt_logits(model: TinyLlama, prompt: list[int]) -> torch.Tensor:
    """Logits [T, V] for every position of `prompt`."""
    return model(torch.tensor([prompt], device=model.lm_head.weight.device))[0]
