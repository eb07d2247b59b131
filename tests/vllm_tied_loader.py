"""vLLM 0.33's own weight-update session on a module with a tied head, run in its own process
(vLLM's parallel state sets up a torch.distributed group, which must not leak into the test
process): for each list of `load_weights` calls, what the tied tensor holds after the session.

    python -m tests.vllm_tied_loader '{"cases": [[["model.embed_tokens.weight"], ...], ...]}'

prints one JSON list: per case, the value served under the embedding's name and the head's (each
name is sent as a tensor filled with its own constant, `VALUES`; 0.0 is what the model held), or
vLLM's error. The module has the parameters the reference engine's loader sees by these names:
an embedding (vLLM's `VocabParallelEmbedding`), a norm, and a `ParallelLMHead` tied to the
embedding by vLLM's own `tie_weights`, as its Llama and Qwen2 classes tie it. The session is
vLLM's: `record_metadata_for_reloading` as its model build calls it (model_loader/utils.py),
`initialize_layerwise_reload` as start_weight_update calls it (nccl_engine.py, ipc_engine.py), the
calls through `AutoWeightsLoader` as the model's `load_weights` makes them, then
`finalize_layerwise_reload` as finish_weight_update calls it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

VALUES = {"model.embed_tokens.weight": 1.0, "lm_head.weight": 2.0, "model.norm.weight": 3.0}


def main(spec: dict) -> list[list[float] | str]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from torch import nn
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
            record_metadata_for_reloading,
        )
        from vllm.model_executor.models.utils import AutoWeightsLoader

    vocab, hidden = 64, 8
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}  # fmt: skip
    answers: list[list[float] | str] = []
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp(prefix='refit-vllm-tied-')}", 0, "gloo")
        initialize_model_parallel(1, 1)

        class Backbone(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed_tokens = VocabParallelEmbedding(vocab, hidden)
                self.norm = nn.LayerNorm(hidden, bias=False)

        for calls in spec["cases"]:
            model = type("Qwen2ForCausalLM", (nn.Module,), {})()
            model.model = Backbone()
            model.lm_head = ParallelLMHead(vocab, hidden).tie_weights(model.model.embed_tokens)
            with torch.no_grad():
                model.model.embed_tokens.weight.zero_()
            record_metadata_for_reloading(model)
            initialize_layerwise_reload(model)
            try:
                for call in calls:
                    AutoWeightsLoader(model).load_weights([(n, torch.full(shapes[n], VALUES[n])) for n in call])
                finalize_layerwise_reload(model, None)
            except ValueError as exc:
                answers.append(str(exc))
                continue
            assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again once the session ends
            answers.append(
                [float(model.model.embed_tokens.weight.flatten()[0]), float(model.lm_head.weight.flatten()[0])]
            )
    return answers


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
