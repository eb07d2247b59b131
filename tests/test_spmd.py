"""Trainer ranks as participants: a real FSDP2 job on 2 gloo ranks (separate processes) refits into
TP=2 reference engines (2 processes each) over shared memory and over the broadcast transport.
Every rank must make the same steps in the same order (so the same collectives) on success, on a
retry, on an abort and when no engine is left; no rank hangs; what the engines serve matches the
gathered trainer weights; refit never holds more than two buckets of extra trainer memory."""

from __future__ import annotations

from typing import Any

import pytest

from refit.spmd import launch

from .conftest import SUMMARY

pytestmark = pytest.mark.e2e
BUCKET = 64 << 10


def run_job(spec: dict[str, Any], world: int = 2) -> list[dict[str, Any]]:
    reports = launch(world, {"bucket_bytes": BUCKET, **spec}, timeout=240)
    for r in reports:
        assert "refits" in r, f"rank {r['rank']} did not report (exit {r.get('exit')}): {r.get('stderr')}"
    return reports


def same_on_every_rank(reports: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Refit n as every rank saw it: the same result, and per-rank step lists that are identical."""
    entries = [r["refits"][n - 1] for r in reports]
    first = entries[0]
    for other in entries[1:]:  # followers return the leader's result
        assert {k: other.get(k) for k in ("state", "version", "engines")} == {
            k: first.get(k) for k in ("state", "version", "engines")
        }
    steps = first["rank_steps"]
    assert len(steps) == len(reports)
    for lane in ("main", "send"):  # each lane runs in order; the two lanes interleave by timing
        per_rank = [[s for s in rank if (s[0] == "send") == (lane == "send")] for rank in steps]
        assert all(s == per_rank[0] for s in per_rank), f"ranks made different {lane}-lane steps: {per_rank}"
    assert max(first["rank_peak_bytes"]) <= 2 * BUCKET, first["rank_peak_bytes"]
    return first


def packs(entry: dict[str, Any]) -> list[tuple[int, int]]:
    return [(b, a) for call, b, a in entry["rank_steps"][0] if call == "pack"]


def aux_alone_in_the_last_bucket() -> None:
    """With `aux_dtype`, the model carries a one-row bfloat16 tensor: under FSDP2 on 2 ranks, rank 1
    owns none of it (and none of that dtype), and it travels alone in the last bucket."""
    from refit.buckets import plan_buckets
    from refit.drivers.torch_source import TorchSource
    from refit.reference.model import ModelConfig, TinyLlama

    plan = plan_buckets(TorchSource(TinyLlama(ModelConfig(aux_dtype="bfloat16"))).metas(), BUCKET)
    assert plan[-1].names == ["aux.weight"] and plan[-1].entries[0].meta.dtype == "bfloat16"


def test_fsdp2_ranks_refit_tp2_engines_over_shm_with_retry_and_abort() -> None:
    aux_alone_in_the_last_bucket()
    faults = {
        "2": "transferring:engine=1:bucket=3:kind=corrupt",  # engine-1 refuses bucket 3: retried, every rank re-streams
        "3": "transferring:bucket=3:call=pack",  # the trainer side fails at bucket 3: the run aborts on every rank
    }
    reports = run_job(
        {
            "transport": "shm",
            "engine_tp": 2,
            "mode": "colocated",
            "refits": 4,
            "faults": faults,
            "aux_dtype": "bfloat16",
        }
    )
    clean = same_on_every_rank(reports, 1)
    assert clean["ok"] and clean["check"]["ok"], clean
    assert clean["check"]["max_diff"] <= 1e-5 and clean["check"]["tokens"] and clean["check"]["weights"]
    n = clean["buckets"]

    retried = same_on_every_rank(reports, 2)
    assert retried["ok"] and retried["check"]["ok"] and retried["engines"]["engine-1"]["attempts"] == 2
    assert packs(retried) == [(b, 0) for b in range(n)] + [(b, 1) for b in range(n)]  # the retry re-read every bucket

    aborted = same_on_every_rank(reports, 3)
    assert aborted["state"] == "FAILED" and aborted["version"] is None
    assert packs(aborted) == [(b, 0) for b in range(3)]  # nobody started bucket 3's gathers
    assert {e["status"] for e in aborted["engines"].values()} == {"quarantined"}

    healed = same_on_every_rank(reports, 4)
    assert healed["ok"] and healed["check"]["ok"] and healed["version"] == 4  # 3 died with the failed run
    SUMMARY.append(
        f"spmd shm: 2 FSDP2 ranks -> 2 TP=2 engines, {n} buckets; trainer peak "
        f"{max(clean['rank_peak_bytes'])} B = {max(clean['rank_peak_bytes']) / BUCKET:.1f} buckets; "
        f"steady state {same_on_every_rank(reports, 4)['round_trips']} control round trips"
    )


def test_fsdp2_ranks_refit_tp2_engines_over_broadcast_through_a_death_and_no_engine_left() -> None:
    faults = {
        "2": "transferring:engine=1:bucket=3:kind=kill",  # breaks the group: rebuilt without engine-1, engine-0 retried
        "4": "transferring:engine=0:bucket=2:kind=kill",  # the last engine dies: nobody left, every rank stops
    }
    reports = run_job(  # disaggregated: rank 1 feeds nobody and only drains (the same gathers as rank 0)
        {"transport": "broadcast", "engine_tp": 2, "mode": "disaggregated", "refits": 4, "faults": faults,
         "aux_dtype": "bfloat16"}
    )  # fmt: skip
    clean = same_on_every_rank(reports, 1)
    assert clean["ok"] and clean["check"]["ok"], clean

    survived = same_on_every_rank(reports, 2)
    assert survived["engines"]["engine-0"] == {"status": "updated", "version": 2, "attempts": 2}
    assert survived["engines"]["engine-1"]["status"] == "failed"
    n = survived["buckets"]
    assert packs(survived)[: n + 1][-1] == (0, 1) or (0, 1) in packs(survived)  # a second pass after the reconnect

    alone = same_on_every_rank(reports, 3)
    assert alone["engines"]["engine-0"]["status"] == "updated" and alone["version"] == 3

    nobody = same_on_every_rank(reports, 4)
    assert nobody["state"] == "FAILED" and nobody["version"] is None
    assert {e["status"] for e in nobody["engines"].values()} == {"failed"}
    assert all(b < 4 for b, _ in packs(nobody))  # streaming stopped for every rank together
    assert nobody["seconds"] < 30  # nobody waited out the 60 s deadline


def test_a_rank_that_never_calls_run_fails_the_leader_clearly_inside_the_deadline() -> None:
    reports = run_job({"leader_only": True, "refits": 1, "deadline": 3.0, "cleanup_grace": 2.0, "check": False})
    leader = reports[0]["refits"][0]
    assert leader["state"] == "FAILED" and leader["wall_s"] < 3.0 + 2.0 + 2.0  # deadline + cleanup grace + slack
    assert "trainer ranks [1] did not answer" in leader["error"] and "every rank must call" in leader["error"]
    assert {e["status"] for e in leader["engines"].values()} == {"unchanged"}


def test_a_follower_whose_leaders_store_goes_away_says_so_not_that_it_waited_zero_seconds() -> None:
    """A follower rank waits in a real TCPStore for rank 0's next command. When rank 0's store
    goes away (its process exited), the wait ends at once: the error says the leader's store was
    lost well inside the deadline, never that the leader 'sent no command for 0.0s'. A wait that
    runs out says it waited the deadline."""
    import datetime
    import gc
    import socket
    import types

    import torch.distributed as dist

    from refit.errors import RefitError
    from refit.protocol.ranks import SpmdRanks

    def ranks() -> tuple[Any, SpmdRanks]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=5),
                               wait_for_workers=False)  # fmt: skip
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=5))
        return master, SpmdRanks(types.SimpleNamespace(rank=1), client, 1, 2, "t")

    master, follower = ranks()
    del master  # rank 0's store is gone
    gc.collect()
    with pytest.raises(RefitError) as lost:
        follower.follow(30.0)
    assert "lost the leader's (rank 0) store after waiting 0." in str(lost.value)
    assert "inside the 30.0s deadline" in str(lost.value) and "sent no command" not in str(lost.value)
    master, follower = ranks()
    with pytest.raises(RefitError, match=r"sent no command for 0\.[3-9]s \(the run's deadline\)"):
        follower.follow(0.3)
    del master
