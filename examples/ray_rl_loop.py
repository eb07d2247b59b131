"""A Ray RL loop that refits its rollout engines between optimizer steps, the way RL frameworks
lay a job out on Ray: the driver is the loop's controller; the learner (one trainer rank here) and
the rollout engines are actors. Run it: `python examples/ray_rl_loop.py` (starts a local cluster).

Each iteration: rollouts from every engine (greedy continuations of a few prompts), a reward per
rollout (the share of its tokens below LOW), one REINFORCE-style step on the learner, then
`protocol.run(ctx)`: the engines pause, take the new weights and continue, and later rollouts say
which weight version produced them.
"""

from __future__ import annotations

import os

import ray
import torch

from refit import protocol
from refit.drivers.ray_actors import RankHost, RayEngine, RayLock, RayRanks
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama

LOW = 64  # the reward: the share of generated tokens below this id
PROMPTS = [[1, 2, 3], [40, 41], [200, 9, 9, 100], [17], [250, 251], [5, 80, 160]]


@ray.remote(num_cpus=0)
class Learner:
    """The trainer: its model, its optimizer, and refit's share of each step (`RankHost`)."""

    def __init__(self, config: dict, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = TinyLlama(ModelConfig(**config), seed=seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.refit = RankHost(TorchSource(self.model, optimizer=self.opt), SharedMemoryTransport(), rank=0, world=1)

    async def refit_step(self, session: str, seq: int, step: object) -> tuple:
        return await self.refit.step(session, seq, step)  # what RayRanks calls, once per trainer-side step

    async def train(self, rollouts: list[tuple[list[int], list[int], float]]) -> float:
        """One policy-gradient step: raise the log-probability of each rollout's tokens in
        proportion to its advantage (reward minus the batch mean)."""
        mean = sum(r for _, _, r in rollouts) / len(rollouts)
        self.opt.zero_grad()
        loss = torch.zeros(())
        for prompt, output, reward in rollouts:
            tokens = torch.tensor([prompt + output])
            logp = torch.log_softmax(self.model(tokens[:, :-1]), dim=-1)
            taken = logp[0, len(prompt) - 1 :].gather(1, tokens[0, len(prompt) :, None]).sum()
            loss = loss - (reward - mean) * taken
        (loss / len(rollouts)).backward()
        self.opt.step()
        return float(loss)


def main(iterations: int = 6) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = ModelConfig()
    learner = Learner.remote(config.to_dict(), 0)
    lock = RayLock("rl-loop-engines")  # every process of the job that names it shares it
    engines = [RayEngine.start(f"rollout-{i}", config, seed=0, lock=lock) for i in range(2)]
    ctx = protocol.RefitContext(
        source=None,  # the weights live in the learner actor
        transport=SharedMemoryTransport(),  # the driver's side only plans and routes
        engines=engines,
        ranks=RayRanks([learner]),
        mode="disaggregated",
        deadline_s=60,
    )
    try:
        for it in range(iterations):
            rollouts = []
            for engine in engines:
                for prompt in PROMPTS:
                    done = engine.generate(prompt, 8)
                    reward = sum(t < LOW for t in done["output"]) / 8
                    rollouts.append((prompt, done["output"], reward))
                    versions = done["weight_versions"]
            mean = sum(r for *_, r in rollouts) / len(rollouts)
            ray.get(learner.train.remote(rollouts))
            result = protocol.run(ctx).raise_for_error()  # between optimizer steps
            print(
                f"iteration {it}: mean reward {mean:.3f} (rollouts from weight version {versions}); "
                f"refit to version {result.version} in {result.seconds * 1e3:.1f} ms, {result.round_trips} round trips"
            )
    finally:
        ctx.close()
        for e in engines:
            e.close()
        ray.shutdown()


if __name__ == "__main__":
    main()
