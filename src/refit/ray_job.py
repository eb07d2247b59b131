"""A trainer job on Ray, as RL frameworks run one: trainer ranks as Ray actors (FSDP2 over gloo
among them), rollout engines as Ray actors, and the driver process (the RL loop's controller)
leading each refit through `RayRanks`. What `refit demo --ray` runs and tests/test_ray.py checks.

  TrainerRank   one trainer rank's actor (async): its shard of the model and optimizer, its own
                Source and Transport, and a `RankHost` that runs the leader's refit steps.
  start_ranks   N rank actors, their process group formed (every rank's `setup` at once).
  RayTrainer    the driver's handle on them: `train(steps)` on every rank, `reference()` (the full
                weights, gathered collectively, as a plain model), `ranks` for the context.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from typing import Any

from refit.drivers.ray_actors import RankHost, RayRanks


class TrainerRank:
    """A trainer rank's actor class (`ray.remote` is applied in `start_ranks`)."""

    def __init__(self, rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
        self.rank, self.world, self.port, self.spec = rank, world, port, spec
        self.host: RankHost | None = None

    async def setup(self) -> int:
        """Join the trainer's process group (every rank at once), build the shard, source,
        transport and RankHost; returns this process's pid."""
        import torch
        import torch.distributed as dist

        from refit.drivers.torch_source import TorchSource
        from refit.loop import make_transport
        from refit.reference.model import ModelConfig
        from refit.spmd import _fsdp_model

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=self.rank, world_size=self.world
        )
        self.config = ModelConfig()
        self.model = _fsdp_model(self.config, self.spec["seed"]) if self.world > 1 else self._plain_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.gen = torch.Generator().manual_seed(self.spec["seed"] + 1 + self.rank)  # each rank its own data
        source = TorchSource(self.model, optimizer=self.opt)
        self.host = RankHost(source, make_transport(self.spec["transport"]), self.rank, self.world)
        return os.getpid()

    def _plain_model(self) -> Any:
        from refit.reference.model import TinyLlama

        return TinyLlama(self.config, seed=self.spec["seed"])

    async def refit_step(self, session: str, seq: int, step: Any) -> tuple[Any, ...]:
        assert self.host is not None, "setup() first"
        return await self.host.step(session, seq, step)

    async def train(self, steps: int) -> float:
        from refit.loop import train

        return train(self.model, self.opt, self.gen, steps, self.config.vocab_size)

    async def full_state(self) -> dict[str, Any] | None:
        """The full weights (a collective: every rank calls it); rank 0 returns them."""
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in self.model.state_dict().items()}
        return full if self.rank == 0 else None

    async def shutdown(self) -> None:
        import torch.distributed as dist

        if self.host is not None:
            self.host.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


@functools.cache
def _rank_actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(TrainerRank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayTrainer:
    """The driver's handle on the trainer rank actors."""

    def __init__(self, actors: list[Any], timeout: float) -> None:
        self.actors = actors
        self.timeout = timeout
        self.ranks = RayRanks(actors)

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=self.timeout)

    def train(self, steps: int) -> float:
        return float(self._all("train", steps)[0])

    def reference(self) -> Any:
        from refit.reference.model import ModelConfig, TinyLlama

        ref = TinyLlama(ModelConfig())
        ref.load_state_dict(self._all("full_state")[0])
        return ref

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)


def start_ranks(world: int, spec: dict[str, Any], *, timeout: float = 120.0) -> RayTrainer:
    """`world` trainer rank actors on the connected Ray cluster, set up (process group formed)."""
    import ray

    cls = _rank_actor_class()
    port = _free_port()
    actors = [cls.remote(r, world, port, {"seed": 0, "transport": "shm", **spec}) for r in range(world)]
    trainer = RayTrainer(actors, timeout)
    try:
        ray.get([a.setup.remote() for a in actors], timeout=timeout)
    except BaseException:
        trainer.close()
        raise
    return trainer
