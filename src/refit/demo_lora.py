"""`refit demo --lora`: LoRA refits end to end on the embedded default. The trainer is the tiny
model wrapped by PEFT (rank-8 adapters on every attention and MLP projection, the base frozen);
between optimizer steps only the adapter moves, into reference-engine processes that keep
generating throughout: a client keeps requests naming the adapter in flight, each pinned to the
version it was admitted with. After each refit every engine's greedy tokens and logits under the
adapter must equal the PEFT model's; the run reports the bytes moved against the adapter's and
the whole model's, the versions live on each engine, and how many requests crossed it.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import torch

from refit import protocol
from refit.loop import LOGIT_TOL, NEW_TOKENS, PROMPTS, train
from refit.reference.model import ModelConfig, TinyLlama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER = "policy"


def lora_problem(args: argparse.Namespace) -> str | None:
    """What `--lora` cannot be combined with (found before anything starts)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return "--lora needs PEFT: pip install 'refit-engine[lora]' (scripts/setup installs it)"
    if args.mode == "colocated" and args.mode_given:
        return (
            "--lora --mode colocated: a LoRA refit loads each adapter version beside the ones requests use while "
            "the engines keep generating; a colocated refit gives the engines' memory to the trainer (docs/lora.md)"
        )
    clashes = [
        ("--atomic", args.atomic), ("--ranks", args.ranks > 1), ("--ray", args.ray),
        ("--engine-tp", args.engine_tp > 1), ("--engine", args.engine != "reference"),
        ("--fail-at", bool(args.fail_at)), ("--verify probe/both", args.verify in ("probe", "both")),
        ("--pause-mode in_place", args.pause_mode == "in_place"),
    ]  # fmt: skip
    named = [flag for flag, clash in clashes if clash]
    if named:
        return (
            f"--lora runs LoRA refits into reference engines that keep generating (disaggregated, one trainer "
            f"process); it does not take {', '.join(named)} yet"
        )
    return None


@torch.no_grad()
def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def run_lora_demo(args: argparse.Namespace) -> int:
    import peft

    from refit.drivers.lora_source import LoraSource
    from refit.drivers.reference import ReferenceEngine
    from refit.loop import make_transport

    torch.manual_seed(args.seed)
    config = ModelConfig()
    base = TinyLlama(config, seed=args.seed)
    full_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(args.seed + 1)
    adapter_bytes = sum(t.numel() * t.element_size() for t in peft.get_peft_model_state_dict(model).values())
    names = [f"engine-{i}" for i in range(args.engines)]
    print(f"starting {args.engines} reference engine {'threads' if args.in_thread else 'processes'} ...", flush=True)
    t0 = time.perf_counter()
    engines = (
        [ReferenceEngine.in_thread(n, config, seed=args.seed) for n in names]
        if args.in_thread
        else ReferenceEngine.spawn_many(names, config, seed=args.seed)
    )
    print(f"engines ready in {time.perf_counter() - t0:.1f}s", flush=True)
    trace = args.trace
    ctx = protocol.RefitContext(
        LoraSource(model, name=ADAPTER), make_transport(args.transport), engines, max_staleness=1,
        bucket_bytes=args.bucket_bytes, deadline_s=args.deadline, retries=args.retries,
        call_timeout_s=args.call_timeout, trace=trace, verify=args.verify or "digest",
    )  # fmt: skip
    print(
        f"trainer: the tiny model with rank-8 LoRA adapters on {len(TARGETS)} projections per layer (PEFT), the base "
        f"frozen | adapter {adapter_bytes / 1024:.0f} KiB of a {full_bytes / 2**20:.2f} MiB model | disaggregated, "
        f"max_staleness 1 (at most 2 adapter versions live; a retired one is freed when its last request ends) | "
        f"verify {ctx.verify}",
        flush=True,
    )
    stop, futures = threading.Event(), []
    started = threading.Event()

    def client() -> None:
        i = 0
        while not stop.is_set():
            for e in engines:
                futures.append(e.submit(PROMPTS[i % len(PROMPTS)], NEW_TOKENS, adapter=ADAPTER))
                i += 1
            started.set()
            futures[-1].result(timeout=60)

    failures: list[str] = []
    thread: threading.Thread | None = None
    print(" refit  version  seconds  bytes moved       live versions  tokens+logits  loss")
    try:
        for k in range(1, args.refits + 1):
            loss = train(model, opt, gen, args.steps, config.vocab_size)
            t = time.perf_counter()
            result = protocol.run(ctx)
            took = time.perf_counter() - t
            if not result.ok:
                failures.append(f"refit {k}: {result.error}")
                print(f"{k:>6}  FAILED: {result.error}")
                break
            if thread is None:  # requests name the adapter once a version of it is live
                thread = threading.Thread(target=client, daemon=True)
                thread.start()
                started.wait(30)
            model.eval()
            ok = True
            for e in engines:
                for prompt in PROMPTS:
                    got = e.generate(prompt, NEW_TOKENS, adapter=ADAPTER)["output"]
                    ok &= got == _greedy(model, prompt, NEW_TOKENS)
                    with torch.no_grad():
                        want = model(torch.tensor([prompt]))[0]
                    diff = float((e.score(prompt, adapter=ADAPTER) - want).abs().max())
                    ok &= diff <= LOGIT_TOL * max(1.0, float(want.abs().max()))
            model.train()
            live = sorted({int(v) for e in engines for v in e.info()["adapters"].get(ADAPTER, {})})
            if not ok:
                failures.append(f"refit {k}: an engine's tokens or logits differ from the PEFT model's")
            print(
                f"{k:>6}  {result.version:>7}  {took:>7.3f}  {result.bytes_moved:>7} B "
                f"({result.bytes_moved / full_bytes:.1%} of the model)  {live!s:<13}  "
                f"{'equal' if ok else 'DIFFER':<13}  {loss:.3f}",
                flush=True,
            )
            if result.bytes_moved != adapter_bytes:
                failures.append(f"refit {k} moved {result.bytes_moved} bytes, the adapter is {adapter_bytes}")
    finally:
        stop.set()
        if thread is not None:
            thread.join(60)
        ctx.close()
        outs = [f.result(timeout=60) for f in futures]
        for e in engines:
            e.close()
    aborted = [o for o in outs if o["finish_reason"] != "length"]
    versions = sorted({o["adapter_version"] for o in outs})
    print(
        f"requests served during the refits: {len(outs)}, aborted {len(aborted)}, each pinned to its version "
        f"(versions seen: {versions})"
    )
    if aborted:
        failures.append(f"{len(aborted)} requests did not finish")
    if trace:
        print(f"trace: {Path(trace)} (refit check {trace})")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    print(f"OK: {args.refits} LoRA refits, adapters only, generation never paused")
    return 0
