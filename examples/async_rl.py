"""An asynchronous RL loop: rollouts never stop while the trainer's weights are refit atomically.
Run it: `python examples/async_rl.py` (CPU, about half a minute; two reference engine processes).

Each engine keeps a few long requests in flight the whole time. Each iteration the learner takes
the finished samples a 2-steps-off-policy trainer may use (`staleness.within`, by the version of
each sample's oldest token), does one REINFORCE-style step, and refits with `atomic=True`: each
engine writes the new weights into a second copy while it goes on generating with the ones it
serves, and stops only for the swap (pause, flush, swap, publish, continue: one round trip).
Held requests are retracted at the swap and recompute their KV under the new weights
(`kv="recompute"`); every token says which version produced it.
"""

from __future__ import annotations

import time

import torch

from refit import protocol, staleness
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama

CONFIG = ModelConfig(max_seq_len=192)
LOW = 64  # the reward: the share of generated tokens below this id
PROMPTS = [[1, 2, 3], [40, 41], [200, 9, 9, 100], [17], [250, 251], [5, 80, 160]]
ITERATIONS, IN_FLIGHT, LENGTH = 5, 3, 160
MAX_STALENESS = 2  # the trainer uses a sample whose oldest token is at most 2 versions old


def main() -> None:
    torch.manual_seed(0)
    model = TinyLlama(CONFIG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engines = ReferenceEngine.spawn_many(["rollout0", "rollout1"], CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, atomic=True, pause_mode="retract", kv="recompute",
    )  # fmt: skip
    inflight: list[tuple[list[int], object]] = []
    n = 0

    def top_up() -> None:  # every engine always has IN_FLIGHT requests running
        nonlocal n
        while len(inflight) < IN_FLIGHT * len(engines):
            prompt = PROMPTS[n % len(PROMPTS)]
            inflight.append((prompt, engines[n % len(engines)].submit(prompt, LENGTH)))
            n += 1

    aborted = 0
    try:
        top_up()
        for it in range(ITERATIONS):
            while sum(f.done() for _, f in inflight) < len(engines):  # wait for a few finished samples
                time.sleep(0.01)
            done = [(p, f.result()) for p, f in inflight if f.done()]
            inflight[:] = [(p, f) for p, f in inflight if not f.done()]
            top_up()  # the engines never run dry: the refit below lands while these generate
            aborted += sum(out["finish_reason"] != "length" for _, out in done)
            current = ctx.published_version
            usable = [(p, o) for p, o in done if staleness.within(o["weight_versions"], current, MAX_STALENESS)]
            counts = staleness.count([o["weight_versions"] for _, o in done], current, MAX_STALENESS)
            if usable:  # REINFORCE on the sampled tokens, the reward centred at 0.5
                opt.zero_grad()
                loss = torch.zeros(())
                for prompt, out in usable:
                    reward = sum(t < LOW for t in out["output"]) / len(out["output"]) - 0.5
                    tokens = torch.tensor([prompt + out["output"]])
                    logp = torch.log_softmax(model(tokens[:, :-1]), dim=-1)
                    loss = loss - reward * logp[0, len(prompt) - 1 :].gather(1, tokens[0, len(prompt) :, None]).sum()
                (loss / len(usable)).backward()
                opt.step()
            result = protocol.run(ctx).raise_for_error()
            print(
                f"iteration {it}: {len(done)} samples, {counts.mixed} of them from two versions or more, "
                f"{counts.beyond} too stale; trained on {len(usable)}; "
                f"published version {result.version}; generation stopped {result.phase_seconds['SWAPPING'] * 1e3:.1f} "
                f"ms for the swap, the copies took {result.phase_seconds['TRANSFERRING'] * 1e3:.1f} ms to write"
            )
        rest = [f.result(timeout=120) for _, f in inflight]
        aborted += sum(out["finish_reason"] != "length" for out in rest)
        staged = sum(e.info()["tokens_while_staged"] for e in engines)
        print(f"{aborted} requests aborted; {staged} tokens were generated while the new weights were written")
    finally:
        ctx.close()
        for e in engines:
            e.close()


if __name__ == "__main__":
    main()
