"""A Megatron trainer job on WORLD CPU ranks (tensor parallel = WORLD, gloo) refitting into
reference engines through `MegatronSource` (test support for tests/test_megatron.py).

Every rank: a tiny HF Llama converted to Megatron by megatron-bridge (`AutoBridge`, TP-sharded),
then per refit one optimizer step on a fixed batch and `protocol.run(ctx)` (rank 0 leads and hosts
the engines; every rank drains the bridge's export in step). After each refit every rank runs the
Megatron forward (a TP collective) and rank 0 checks the engine against it: weights read back bit
for bit against the bridge's export, logits within fp32 tolerance, and the engine's logits before
the refit clearly different.

    python -m tests.megatron_job RANK WORLD HF_DIR SPEC_JSON OUT_JSON   (MASTER_ADDR/PORT set)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 100, 12], list(range(20, 45))]


def megatron_logits(mg: Any, model: Any, tokens: list[int], tp: int) -> Any:
    """The Megatron model's logits [len, vocab] (every TP rank calls it: the vocab is sharded)."""
    import torch
    import torch.distributed as dist

    from .megatron_support import causal_mask

    ids = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    with torch.no_grad():
        out = model(ids, pos, causal_mask(len(tokens)))[0]
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=mg.parallel_state.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out.float()


def run(rank: int, world: int, hf_dir: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from refit import protocol
    from refit.drivers.megatron import MegatronSource
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport
    from refit.loop import summary
    from refit.reference.model import ModelConfig

    from .megatron_support import causal_mask, cpu_provider, load, load_weights

    t0 = time.monotonic()
    mg = load()
    report: dict[str, Any] = {"rank": rank, "import_s": round(time.monotonic() - t0, 2), "refits": []}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mg.parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    bridge = mg.AutoBridge.from_hf_pretrained(hf_dir)
    provider = cpu_provider(mg, bridge, tp=world)
    provider.finalize()
    model = provider.provide()
    load_weights(bridge, model)
    report["local_params"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 3e-2))
    gen = torch.Generator().manual_seed(1)  # the same batch on every rank: TP ranks see the same data
    vocab = AutoConfig.from_pretrained(hf_dir).vocab_size

    engines: list[Any] = []
    if rank == 0:
        config = ModelConfig.from_hf(AutoConfig.from_pretrained(hf_dir))
        engines = [ReferenceEngine.spawn("megatron-engine", config, seed=5, tp=spec.get("engine_tp", 1))]
    try:
        ctx = protocol.RefitContext(
            source=MegatronSource(bridge, [model], cpu=True), transport=SharedMemoryTransport(), engines=engines,
            mode="disaggregated", bucket_bytes=spec.get("bucket_bytes", 16 << 10), deadline_s=120.0,
            call_timeout_s=60.0,
        )  # fmt: skip
        for _ in range(spec.get("refits", 2)):
            model.train()
            ids = torch.randint(0, vocab, (2, 16), generator=gen)
            pos = torch.arange(16)[None].expand(2, 16)
            loss = model(ids, pos, causal_mask(16), labels=ids).float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            before = [engines[0].score(p).float() for p in PROMPTS] if rank == 0 else []
            result = protocol.run(ctx)
            entry: dict[str, Any] = {"loss": float(loss), **(summary(result) if rank == 0 else {"ok": result.ok})}
            logits = [megatron_logits(mg, model, p, world) for p in PROMPTS]  # every rank: a collective
            exported = {n: t.clone() for n, t in bridge.export_hf_weights([model], cpu=True, show_progress=False)}
            if rank == 0:
                served = engines[0].state_dict()
                entry["weights_equal"] = sorted(served) == sorted(exported) and all(
                    torch.equal(served[n], exported[n]) for n in exported
                )
                entry["tensors"] = len(exported)
                scored = [engines[0].score(p).float() for p in PROMPTS]
                entry["logit_diff"] = max(float((s - m).abs().max()) for s, m in zip(scored, logits, strict=True))
                entry["logit_scale"] = max(float(m.abs().max()) for m in logits)
                entry["before_diff"] = max(float((b - m).abs().max()) for b, m in zip(before, logits, strict=True))
                entry["greedy_equal"] = all(
                    engines[0].generate(p, 4)["output"] == _greedy(mg, model, p, 4, world) for p in PROMPTS[:1]
                )
            else:
                for p in PROMPTS[:1]:
                    _greedy(mg, model, p, 4, world)
            report["refits"].append(entry)
        ctx.close()
    finally:
        for e in engines:
            e.close()
    dist.destroy_process_group()
    return report


def _greedy(mg: Any, model: Any, prompt: list[int], n: int, tp: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(megatron_logits(mg, model, ids, tp)[-1].argmax()))
    return ids[len(prompt) :]


def main(argv: list[str]) -> int:
    rank, world, hf_dir, spec, out = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3]), Path(argv[4])
    out.write_text(json.dumps(run(rank, world, hf_dir, spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
