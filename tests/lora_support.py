"""Helpers of the LoRA tests against emulated servers (tests/test_sglang_lora.py, test_vllm_lora.py):
a PEFT model of the reference's tiny model, a 'training step' of its adapter, and PEFT's own greedy
tokens under a snapshot of it (the oracle)."""

from __future__ import annotations

from typing import Any

import torch

from refit.reference.model import ModelConfig, TinyLlama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(r: int = 4, **kw: Any) -> Any:
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=kw.pop("targets", TARGETS),
                             init_lora_weights=False, **kw)  # fmt: skip
    return peft.get_peft_model(TinyLlama(ModelConfig(), seed=0), config).eval()


def train(model: Any, step: int) -> dict[str, torch.Tensor]:
    """One 'training step' of the adapter; returns a snapshot of it (the oracle of that version)."""
    import peft

    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return {n: t.detach().clone() for n, t in peft.get_peft_model_state_dict(model).items()}


def greedy(model: Any, snapshot: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    """PEFT's greedy tokens with `snapshot` as the adapter."""
    import copy

    import peft

    oracle = copy.deepcopy(model)
    peft.set_peft_model_state_dict(oracle, snapshot)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(oracle(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]
