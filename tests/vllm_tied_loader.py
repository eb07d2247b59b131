"""vLLM 0.33's own `AutoWeightsLoader` (model_executor/models/utils.py) on a module with a tied head,
run in its own process (vLLM's parallel state sets up a torch.distributed group, which must not
leak into the test process): for each list of `load_weights` calls, vLLM's answer to the first
call that raises, or None.

    python -m tests.vllm_tied_loader '{"model": "Qwen2ForCausalLM", "cases": [[["lm_head.weight"]], ...]}'

prints one JSON list. The module has the parameters the reference engine's loader sees by these
names: the embedding (vLLM's `VocabParallelEmbedding`), a norm, and a `ParallelLMHead` tied to
the embedding by vLLM's own `tie_weights`, as its Llama and Qwen2 classes tie it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings


def main(spec: dict) -> list[str | None]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from torch import nn
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
        from vllm.model_executor.models.utils import AutoWeightsLoader

    vocab, hidden = 64, 8
    with set_current_vllm_config(VllmConfig()):
        path = tempfile.mktemp(prefix="refit-vllm-tied-")
        init_distributed_environment(1, 0, f"file://{path}", 0, "gloo")
        initialize_model_parallel(1, 1)

        class Backbone(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed_tokens = VocabParallelEmbedding(vocab, hidden)
                self.norm = nn.LayerNorm(hidden, bias=False)

        model = type(spec["model"], (nn.Module,), {})()  # vLLM names the class in its message
        model.model = Backbone()
        model.lm_head = ParallelLMHead(vocab, hidden).tie_weights(model.model.embed_tokens)
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                  "model.norm.weight": (hidden,)}  # fmt: skip
        answers: list[str | None] = []
        for calls in spec["cases"]:
            answer = None
            for call in calls:
                try:
                    AutoWeightsLoader(model).load_weights([(n, torch.randn(shapes[n])) for n in call])
                except ValueError as exc:
                    answer = str(exc)
                    break
            answers.append(answer)
    return answers


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
