"""Per-token weight versions: a request's version changes only at a commit point, never between
buckets. Pure functions over what an engine reports, checked live (tests, `refit.testing`), and
under Hypothesis over random interleavings of requests and refits (`tests/test_token_versions.py`).

  token_version  every token an engine sampled carries the version label and the weights epoch
                 (`weights_epochs`: the engine's count of changes to its served weights) it was
                 sampled under, and that pair is one of the engine's commit points: the
                 (version, epoch) pairs it served as whole versions (its checkpoint, each
                 publish after a complete update, each intact resume of released weights). A
                 token sampled while a bucket of the next version had landed has an epoch no
                 commit names; a label set without a complete update names a pair no commit
                 has. Within a request the versions never decrease. Where the refit trace is
                 given, each version a token carries was published to that engine by a run
                 that committed it (or is the version the engine started from).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from refit.invariants._core import Event, Violation


def published_versions(events: Iterable[Event], engine: str) -> set[int]:
    """The versions the refit trace records as published to `engine` (a `publish` call that
    succeeded), and the version the first run says the engines held before it."""
    out: set[int] = set()
    first = True
    for ev in events:
        if ev.get("kind") == "run" and ev.get("event") == "start" and first:
            if isinstance(ev.get("previous_version"), int):
                out.add(ev["previous_version"])
            first = False
        ours = ev.get("event") == "publish" and ev.get("engine") == engine and ev.get("outcome") == "ok"
        if ours and isinstance(ev.get("version"), int):
            out.add(ev["version"])
    return out


def check_token_versions(
    commits: Sequence[Sequence[int]],
    requests: Iterable[Mapping[str, Any]],
    *,
    engine: str = "engine",
    published: set[int] | None = None,
) -> list[Violation]:
    """`commits`: the engine's (version, epoch) commit points; `requests`: its finished requests
    as it reports them (`output`, `weight_versions`, `weights_epochs`); `published`: the versions
    the refit trace published to it (`published_versions`), when there is a trace."""
    valid = {(int(v), int(e)) for v, e in commits}
    out: list[Violation] = []
    for req in requests:
        rid = req.get("rid", "?")
        tokens = req.get("output") or []
        versions, epochs = req.get("weight_versions"), req.get("weights_epochs")
        lengths_differ = not isinstance(versions, list) or not isinstance(epochs, list) or len(versions) != len(tokens)
        if lengths_differ or len(epochs) != len(tokens):
            msg = f"engine {engine} request {rid}: {len(tokens)} tokens without one version and epoch each"
            out.append(Violation("token_version", msg))
            continue
        last = None
        for i, (v, e) in enumerate(zip(versions, epochs, strict=True)):
            if (v, e) not in valid:
                what = "after a bucket landed (between buckets)" if any(c[0] == v for c in valid) else "under a label"
                msg = (
                    f"engine {engine} request {rid} token {i}: sampled {what}: version {v} at weights epoch {e}, "
                    f"which no commit point names (commits {sorted(valid)[-4:]})"
                )
                out.append(Violation("token_version", msg))
                break
            if published is not None and v not in published:
                msg = f"engine {engine} request {rid} token {i}: version {v}, which the trace never published to it"
                out.append(Violation("token_version", msg))
                break
            if last is not None and v < last:
                msg = f"engine {engine} request {rid} token {i}: version {v} after {last}"
                out.append(Violation("token_version", msg))
                break
            last = v
    return out
