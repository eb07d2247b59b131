"""A collective group (the broadcast transport) is all-or-nothing per bucket: an attempt streams
through it only when its members are exactly the engines that load. A member that left before
the transfer (its begin failed), or an engine a retry leaves out (it is already done), would hold
every send until the group's timeout; the run rebuilds the group first."""

from __future__ import annotations

from pathlib import Path

import pytest

from refit import invariants, protocol
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama
from refit.replay import replay
from refit.trace import load_trace

from .conftest import CONFIG, SMALL_BUCKET, matches, perturbed


@pytest.mark.parametrize(("state", "call"), [("invalidating", "begin"), ("invalidating", "flush")])
def test_a_member_that_left_before_the_transfer_is_left_out_of_the_group(tmp_path: Path, state: str, call: str) -> None:
    engines = [ReferenceEngine.in_thread(f"g{i}", CONFIG, seed=0) for i in range(3)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=12)
    trace = tmp_path / "g.jsonl"
    plan = protocol.FaultPlan().fail_at(state, engine=1, call=call, kind="raise")
    ctx = protocol.RefitContext(
        TorchSource(model), BroadcastTransport(), engines, bucket_bytes=SMALL_BUCKET, retries=1, faults=plan,
        trace=trace, deadline_s=60.0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert result.ok and all(matches(e, model) for e in engines)
    finally:
        ctx.close()
        for e in engines:
            e.close()
    attempts = {n: o.attempts for n, o in result.engines.items()}
    assert attempts == {"g0": 1, "g1": 2, "g2": 1}  # only the one that failed is retried
    _, events, _ = load_trace(trace)
    sends = [e for e in events if e.get("kind") == "call" and e.get("event") == "send"]
    assert sends and all(e["outcome"] == "ok" for e in sends)  # no send waited on a member that never received
    moves = [(e["event"], e["src"]) for e in events if e.get("kind") == "transition"]
    assert ("reconnect", "INVALIDATING") in moves and ("transfer", "RECONNECTING") in moves
    assert invariants.check_trace(events) == []
    assert replay(trace).divergence is None
