"""The staleness bound (`refit.staleness`): properties under Hypothesis, and samples a reference
engine generated while refits ran through it (requests retracted, not aborted, and continued
under the new weights: their tokens span versions)."""

from __future__ import annotations

import time

import hypothesis.strategies as st
import pytest
from hypothesis import given

from refit import protocol, staleness
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama

from .conftest import CONFIG, SMALL_BUCKET, perturbed

samples = st.lists(st.lists(st.integers(0, 20), max_size=12), max_size=8)


@given(samples, st.integers(0, 5))
def test_a_sample_is_as_stale_as_its_oldest_token(batch: list[list[int]], bound: int) -> None:
    current = max((v for s in batch for v in s), default=0) + 1
    counts = staleness.count(batch, current, bound)
    for s in batch:
        want = current - min(s) if s else 0
        assert staleness.lag(s, current) == want
        assert staleness.within(s, current, bound) == (want <= bound)
        assert staleness.within(s, current, want) and (want == 0 or not staleness.within(s, current, want - 1))
    assert counts.samples == len(batch) == counts.within + counts.beyond
    assert counts.mixed == sum(len(set(s)) > 1 for s in batch)
    assert sum(counts.samples_by_lag.values()) == len(batch)
    assert sum(counts.tokens_by_lag.values()) == sum(map(len, batch))
    assert counts.max_lag == max(counts.samples_by_lag, default=0)
    assert counts.within == sum(n for gap, n in counts.samples_by_lag.items() if gap <= bound)


def test_versions_from_the_future_and_nonsense_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="after the current version 3"):
        staleness.lag([2, 4], 3)
    with pytest.raises(ValueError, match="sample 1: token 0"):
        staleness.count([[1], [True]], 3, 0)
    with pytest.raises(ValueError, match="max_staleness"):
        staleness.within([1], 3, -1)
    with pytest.raises(ValueError, match="current"):
        staleness.count([], 1.5, 0)  # type: ignore[arg-type]


def _generated(engine: ReferenceEngine, n: int, at_least: int) -> None:
    """Wait until each of the engine's first `n` requests has `at_least` output tokens."""
    deadline = time.monotonic() + 60
    while min(len(engine.client.call("result", rid, timeout=10)["output"]) for rid in range(n)) < at_least:
        assert time.monotonic() < deadline, "the engine stopped generating"
        time.sleep(0.005)


def test_samples_generated_across_refits_are_counted_by_their_oldest_token() -> None:
    """Long requests on a reference engine process while three refits go through it (retract:
    each request keeps its tokens, its KV is recomputed under the new weights): every token is
    versioned, a sample's versions never go down and move only to a published version, and the
    counts say which samples a synchronous (0) or one-step-off (1) trainer may use."""
    engine = ReferenceEngine.spawn("s0", CONFIG, seed=0)
    model = TinyLlama(CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [engine], mode="disaggregated", pause_mode="retract",
        bucket_bytes=SMALL_BUCKET,
    )  # fmt: skip
    try:
        futures = [engine.submit([3 + i, 1, 4, 1, 5], 240) for i in range(4)]
        published = [0]
        for step in (1, 2, 3):
            _generated(engine, 4, 20 * step)  # each request has tokens of the version before this refit
            perturbed(model, seed=step)
            result = protocol.run(ctx)
            assert result.ok, result.error
            published.append(result.version)
        outs = [f.result(timeout=120) for f in futures]
        late = engine.generate([9, 9, 9], 4)  # started after the last refit: current throughout
    finally:
        ctx.close()
        engine.close()
    current = published[-1]
    batch = [o["weight_versions"] for o in outs] + [late["weight_versions"]]
    for o, versions in zip([*outs, late], batch, strict=True):
        assert len(versions) == len(o["output"]) and o["finish_reason"] == "length"
        assert versions == sorted(versions) and set(versions) <= set(published)
    sync, one_off = staleness.count(batch, current, 0), staleness.count(batch, current, 1)
    assert sync.samples == 5 and sync.mixed == 4 and sync.max_lag == 3  # the long ones began at version 0
    assert late["weight_versions"] == [current] * 4 and sync.within >= 1
    assert one_off.within >= sync.within and one_off.beyond == sum(
        n for gap, n in one_off.samples_by_lag.items() if gap > 1
    )
