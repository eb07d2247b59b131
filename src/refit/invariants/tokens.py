"""Per-token weight versions: a request's version changes only at a commit point, never between
buckets. Pure functions over what an engine reports, checked live (tests, `refit.testing`), and
under Hypothesis over random interleavings of requests and refits (`tests/test_inflight.py`).

  token_version  every token an engine sampled carries the version label and the weights epoch
                 (`weights_epochs`: the engine's count of changes to its served weights) it was
                 sampled under, and that pair is one of the engine's commit points: the
                 (version, epoch) pairs it served as whole versions (its checkpoint, each
                 publish after a complete update, each intact resume of released weights). A
                 token sampled while a bucket of the next version had landed has an epoch no
                 commit names; a label set without a complete update names a pair no commit
                 has. Within a request neither the version nor the epoch goes back. Where the
                 refit trace is given, each version a token carries was published to that
                 engine (or is the version the engine started from). Not caught here: decoding
                 while paused before the first bucket or after the publish (a valid pair); that
                 shows as tokens read from old-weight KV (`stale_kv_tokens`) under kv="recompute".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from refit.invariants._core import Event, Violation


def published_versions(events: Iterable[Event], engine: str) -> set[int]:
    """The versions the refit trace records as published to `engine` (any `publish` call that
    succeeded, whether or not its run ended ok), and the version the first run says the engines
    held before it."""
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


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_token_versions(
    commits: Any,
    requests: Any,
    *,
    engine: str = "engine",
    published: set[int] | None = None,
) -> list[Violation]:
    """`commits`: the engine's (version, epoch) commit points; `requests`: its finished requests
    as it reports them (`output`, `weight_versions`, `weights_epochs`); `published`: the versions
    the refit trace published to it (`published_versions`), when there is a trace. Malformed input
    is reported as a violation, never raised."""

    def bad(msg: str) -> list[Violation]:
        return [Violation("token_version", f"engine {engine}: {msg}")]

    if not isinstance(commits, list | tuple) or not all(
        isinstance(c, list | tuple) and len(c) == 2 and _count(c[0]) and _count(c[1]) for c in commits
    ):
        return bad(f"its commit points are not (version, epoch) counts: {str(commits)[:120]}")
    valid = {(c[0], c[1]) for c in commits}
    if not isinstance(requests, list | tuple):
        return bad(f"its requests are not a list: {str(requests)[:120]}")
    out: list[Violation] = []
    for req in requests:
        if not isinstance(req, Mapping):
            out += bad(f"a request is not a mapping: {str(req)[:120]}")
            continue
        rid = req.get("rid", "?")
        tokens, versions, epochs = req.get("output"), req.get("weight_versions"), req.get("weights_epochs")
        if not isinstance(tokens, list) or not isinstance(versions, list) or not isinstance(epochs, list):
            out += bad(f"request {rid}: no list of tokens, versions and epochs")
            continue
        if not len(versions) == len(epochs) == len(tokens):
            out += bad(f"request {rid}: {len(tokens)} tokens, {len(versions)} versions, {len(epochs)} epochs")
            continue
        last: tuple[int, int] | None = None
        for i, (v, e) in enumerate(zip(versions, epochs, strict=True)):
            if not _count(v) or not _count(e):
                out += bad(f"request {rid} token {i}: version {v!r} and epoch {e!r} are not counts")
                break
            if (v, e) not in valid:
                what = "after a bucket landed (between buckets)" if any(c[0] == v for c in valid) else "under a label"
                out += bad(
                    f"request {rid} token {i}: sampled {what}: version {v} at weights epoch {e}, which no commit "
                    f"point names (commits {sorted(valid)[-4:]})"
                )
                break
            if published is not None and v not in published:
                out += bad(f"request {rid} token {i}: version {v}, which the trace never published to it")
                break
            if last is not None and (v < last[0] or e < last[1]):
                out += bad(
                    f"request {rid} token {i}: version {v} at epoch {e} after version {last[0]} at epoch {last[1]}"
                )
                break
            last = (v, e)
    return out
