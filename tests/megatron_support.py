"""Megatron-Core and megatron-bridge on the CPU, for the Megatron refit test (test support only).

scripts/setup installs megatron-core 0.16.1 on the CPU torch (its base deps are torch, numpy,
packaging) and megatron-bridge 0.3.1 with `--no-deps` plus omegaconf, einops and rich: its full
dependency tree needs CUDA builds (transformer-engine, mamba-ssm, ...). What it takes to run them
on a CPU, kept here and nowhere in refit itself:

1. Import megatron.core's modules first, so they record "no Transformer Engine" before step 2
   (a stand-in TE would make them take the TE branches).
2. Stand-ins (tests/standins.py) for the CUDA-only packages megatron-bridge imports at the top of
   modules we never call into (LoRA layers, Mamba, vision models, loggers): `CUDA_ONLY` below.
3. Three patches to megatron-core 0.16.1, each replacing a hard-coded CUDA device on the CPU path:
   - `GlobalMemoryBuffer.get_tensor` allocates with `device=torch.cuda.current_device()`
     (reached from the local DotProductAttention): a CPU buffer instead;
   - `get_cuda_rng_tracker().fork()` forks the CUDA RNG state (dropout regions): no fork (there is
     no CUDA RNG; these tests use no dropout);
   - `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`: it stays on the
     CPU (the call runs with `current_device` answering "cpu").
   The forward also builds a default causal mask on "cuda" when none is given: callers pass
   `causal_mask(n)`, as Megatron's own training loop does. And megatron-bridge's loading of
   replicated tensors under TP > 1 moves them to `torch.cuda.current_device()`: `load_weights`
   runs it with `current_device` answering "cpu".
4. The bridge's model provider: the local (non-TE) layer spec, CPU initialization, fp32, the fusions
   (which need TE or Apex) off, and the process groups taken from megatron's parallel_state.
"""

from __future__ import annotations

import operator
import types
import warnings
from contextlib import nullcontext
from functools import reduce
from typing import Any
from unittest import mock

from .standins import install

CUDA_ONLY = (
    "apex", "causal_conv1d", "fla", "flash_attn", "flashinfer", "mamba_ssm", "tensorboard",
    "transformer_engine", "triton", "wandb", "torchvision",
)  # fmt: skip


def load() -> types.SimpleNamespace:
    """Megatron-Core (patched for the CPU) and megatron-bridge's AutoBridge; idempotent."""
    import torch

    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": known, on purpose
        warnings.simplefilter("ignore")
        import megatron.core.utils as core_utils
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import random as tp_random

        install(CUDA_ONLY)
        _patch(torch, core_utils, tp_random, RotaryEmbedding)
        from megatron.bridge import AutoBridge
    return types.SimpleNamespace(
        AutoBridge=AutoBridge,
        parallel_state=parallel_state,
        tensor_parallel=tensor_parallel,
        local_spec=get_gpt_layer_local_spec,
        ProcessGroupCollection=ProcessGroupCollection,
    )


def _patch(torch: Any, core_utils: Any, tp_random: Any, rotary: Any) -> None:
    if getattr(rotary.get_emb, "_refit_cpu", False):
        return

    def get_tensor(self: Any, tensor_shape: Any, dtype: Any, name: Any, mem_alloc_context: Any = None) -> Any:
        n = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype, device="cpu")
        return buf[:n].view(*tensor_shape)

    core_utils.GlobalMemoryBuffer.get_tensor = get_tensor
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: nullcontext()
    original = rotary.get_emb

    def get_emb(self: Any, *args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            return original(self, *args, **kwargs)

    get_emb._refit_cpu = True  # type: ignore[attr-defined]
    rotary.get_emb = get_emb


def cpu_provider(mg: types.SimpleNamespace, bridge: Any, *, tp: int = 1) -> Any:
    """The bridge's GPT model provider, set up to build and run on the CPU (see the module doc)."""
    import torch

    provider = bridge.to_megatron_provider(load_weights=False)
    provider.transformer_layer_spec = mg.local_spec()
    provider.use_cpu_initialization = True
    provider.params_dtype = torch.float32
    provider.tensor_model_parallel_size = tp
    for flag in (
        "apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
        "gradient_accumulation_fusion", "persist_layer_norm", "cross_entropy_loss_fusion",
    ):  # fmt: skip
        setattr(provider, flag, False)
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0
    provider._pg_collection = mg.ProcessGroupCollection.use_mpu_process_groups()
    return provider


def load_weights(bridge: Any, model: Any) -> None:
    """`bridge.load_hf_weights([model])` on the CPU (see the module doc)."""
    import torch

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        bridge.load_hf_weights([model])


def causal_mask(n: int) -> Any:
    import torch

    return torch.triu(torch.ones(n, n), diagonal=1).bool()[None, None]
