"""Regenerate the failing traces in this folder from real runs (engine processes, real faults).

    python tests/traces/make_traces.py

Each trace is a regression fixture: tests/test_replay.py replays it through the current runner and
fails if the code now takes a different path. Regenerate only on purpose, and say why in the
commit (the diff of a trace shows what the runner now does differently).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

DEMO_TRACES = {
    # an engine process is SIGKILLed while copying bucket 2: the other engine still takes the version
    "kill-mid-transfer.jsonl": ["--fail-at", "transferring:engine=1:bucket=2:kind=kill"],
    # an engine stalls on pause: dropped after its call timeout, the other engine finishes
    "hang-on-pause.jsonl": ["--fail-at", "pausing:engine=0:kind=hang", "--call-timeout", "1"],
    # bucket 0's bytes arrive damaged at engine 0: checksum refusal, retry, caught up
    "corrupt-then-retried.jsonl": ["--fail-at", "transferring:engine=0:bucket=0:kind=corrupt"],
    # the trainer fails after 4 buckets: the run fails, both engines are quarantined
    "trainer-fails-mid-transfer.jsonl": ["--fail-at", "transferring:bucket=4:call=pack"],
    # engine 1 dies while finalizing, with no retries allowed
    "kill-on-finalize-no-retry.jsonl": ["--fail-at", "post_processing:engine=1:kind=kill", "--retries", "0"],
    # broadcast: engine 1 dies mid-broadcast; the group is rebuilt without it and engine 0 retried
    "broadcast-kill-reconnect.jsonl": [
        "--transport",
        "broadcast",
        "--mode",
        "disaggregated",
        "--fail-at",
        "transferring:engine=1:bucket=2:kind=kill",
    ],
}


def main() -> None:
    only = set(sys.argv[1:])  # regenerate just these files, if named
    for name, args in DEMO_TRACES.items():
        if only and name not in only:
            continue
        path = HERE / name
        cmd = [sys.executable, "-m", "refit.cli", "demo", "--refits", "1", "--steps", "5", "--trace", str(path), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        print(f"{name}: demo exit {proc.returncode}, {len(path.read_text().splitlines())} lines")
    if not only or "bad-manifest-refused.jsonl" in only:
        write_bad_manifest(HERE / "bad-manifest-refused.jsonl")


def write_bad_manifest(path: Path) -> None:
    """A source whose tensor has the wrong shape: every engine refuses the plan before any byte."""
    import torch

    from refit import protocol
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport
    from refit.drivers.torch_source import TorchSource
    from refit.reference.model import ModelConfig, TinyLlama

    model = TinyLlama(ModelConfig(), seed=0)
    state = dict(model.state_dict())
    state["model.norm.weight"] = torch.ones(65)  # one element too many
    engines = ReferenceEngine.spawn_many(["engine-0", "engine-1"])
    ctx = protocol.RefitContext(TorchSource(state), SharedMemoryTransport(), engines, bucket_bytes=64 << 10, trace=path)
    result = protocol.run(ctx)
    ctx.close()
    for e in engines:
        e.close()
    print(f"{path.name}: {result.state}, {result.error}")


if __name__ == "__main__":
    main()
