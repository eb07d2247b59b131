"""How far behind the current weights a sample is: the staleness bound of asynchronous RL.

A sample's tokens each carry the weight version they were sampled under (the reference engine's
and the SGLang and vLLM drivers' `generate` return `weight_versions`, one per output token). A
sample is as stale as its oldest token: `lag` is the current version minus the oldest token's. It
is within a run's `max_staleness` when that lag is at most the bound, as AReaL's staleness control
(the policy version a sample was generated under may trail the trainer's by at most eta) and
prime-rl's maximum off-policy steps bound it; 0 is synchronous RL. A sample whose tokens span
several versions was generated across a refit (in-flight): `mixed`.

Pure functions, no I/O: the trainer calls them on the samples it is about to train on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def _version(v: object, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: a weight version is a non-negative int, got {v!r}")
    return v


def lag(token_versions: Sequence[int], current: int) -> int:
    """Versions between the sample's oldest token and `current` (0: every token is current; a
    sample without tokens is current). A token of a version after `current` is refused."""
    current = _version(current, "current")
    versions = [_version(v, f"token {i}") for i, v in enumerate(token_versions)]
    if not versions:
        return 0
    newest = max(versions)
    if newest > current:
        raise ValueError(f"a token was sampled under version {newest}, after the current version {current}")
    return current - min(versions)


def within(token_versions: Sequence[int], current: int, max_staleness: int) -> bool:
    """Whether the sample may be trained on at `current` under `max_staleness` (0: only samples
    whose every token is of the current version)."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness is a non-negative int, got {max_staleness!r}")
    return lag(token_versions, current) <= max_staleness


@dataclass(frozen=True)
class StalenessCounts:
    """A batch of samples against the current version and the bound: how many are `within` it and
    `beyond` it, how many were generated across a refit (`mixed`), the largest lag, and how many
    samples and tokens lag by each amount (`samples_by_lag`, `tokens_by_lag`: a token's own lag)."""

    current: int
    max_staleness: int
    samples: int = 0
    within: int = 0
    beyond: int = 0
    mixed: int = 0
    max_lag: int = 0
    samples_by_lag: dict[int, int] = field(default_factory=dict)
    tokens_by_lag: dict[int, int] = field(default_factory=dict)


def count(samples: Iterable[Sequence[int]], current: int, max_staleness: int) -> StalenessCounts:
    """`StalenessCounts` of `samples` (each a sample's per-token versions)."""
    within(  # checks the bound and the current version once, even for no samples
        (), current, max_staleness
    )
    n = ok = mixed = worst = 0
    by_sample: dict[int, int] = {}
    by_token: dict[int, int] = {}
    for i, versions in enumerate(samples):
        try:
            gap = lag(versions, current)
        except ValueError as exc:
            raise ValueError(f"sample {i}: {exc}") from None
        n += 1
        ok += gap <= max_staleness
        mixed += len(set(versions)) > 1
        worst = max(worst, gap)
        by_sample[gap] = by_sample.get(gap, 0) + 1
        for v in versions:
            by_token[current - v] = by_token.get(current - v, 0) + 1
    return StalenessCounts(
        current,
        max_staleness,
        n,
        ok,
        n - ok,
        mixed,
        worst,
        dict(sorted(by_sample.items())),
        dict(sorted(by_token.items())),
    )
