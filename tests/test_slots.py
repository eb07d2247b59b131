"""SlotPool: the one record, for every transport, of which bucket occupies which reusable buffer."""

from __future__ import annotations

import itertools

import pytest

from refit.drivers.slots import SlotPool


def _pool(count: int = 2, **kwargs) -> SlotPool[list[int]]:
    made = itertools.count()
    return SlotPool(count, lambda: [next(made)], owner="test transport", **kwargs)


def test_a_free_slot_is_taken_lowest_first() -> None:
    pool = _pool()
    first, second = pool.buffers
    assert pool.take(7) is first and pool.held == [7, None]
    assert pool.take(8) is second and pool.held == [7, 8]
    assert 7 in pool and 8 in pool and 9 not in pool and None not in pool
    assert pool.slot_of(8) == 1 and pool.buffer_of(8) is second
    assert len(pool) == 2


def test_a_full_pool_names_what_its_slots_hold() -> None:
    pool = _pool()
    pool.take(0)
    pool.take(1)
    with pytest.raises(RuntimeError, match=r"^test transport: no free buffer for bucket 2; buckets \[0, 1\] wait"):
        pool.take(2)
    assert pool.held == [0, 1]  # nothing was overwritten


def test_a_transport_words_its_own_errors() -> None:
    pool = _pool(1, full="{owner} is full for {bucket} ({held})", missing="{owner} lacks {bucket} ({held})")
    pool.take(3)
    with pytest.raises(RuntimeError, match=r"^test transport is full for 4 \(\[3\]\)$"):
        pool.take(4)
    with pytest.raises(RuntimeError, match=r"^test transport lacks 5 \(\[3\]\)$"):
        pool.release(5)


def test_release_frees_the_slot_and_keeps_its_buffer() -> None:
    pool = _pool()
    buffer = pool.take(0)
    pool.take(1)
    pool.release(0)
    assert pool.held == [None, 1] and 0 not in pool
    assert pool.take(2) is buffer  # the released slot is the one reused
    with pytest.raises(RuntimeError, match=r"no buffer holds bucket 0 \(slots hold \[2, 1\]\)"):
        pool.release(0)  # a double release is an error, not a no-op


def test_abandon_replaces_the_buffer_and_frees_the_slot() -> None:
    pool = _pool()
    old = pool.take(0)
    new = pool.abandon(0)
    assert new is not old and pool.buffers[0] is new and pool.held == [None, None]
    assert pool.take(1) is new  # the abandoned buffer is never handed out again
    assert all(b is not old for b in pool.buffers)


def test_an_unknown_bucket_is_named() -> None:
    pool = _pool()
    pool.take(0)
    for ask in (pool.slot_of, pool.buffer_of, pool.release, pool.abandon):
        with pytest.raises(
            RuntimeError, match=r"^test transport: no buffer holds bucket 5 \(slots hold \[0, None\]\)$"
        ):
            ask(5)


def test_a_lazy_pool_makes_each_buffer_at_its_first_take() -> None:
    calls = []
    pool = SlotPool(2, lambda: calls.append(1) or len(calls), owner="lazy", lazy=True)
    assert pool.buffers == [] and calls == []
    assert pool.take(0) == 1 and pool.buffers == [1]
    pool.release(0)
    assert pool.take(1) == 1 and calls == [1]  # made once, then reused
    assert pool.take(2) == 2 and pool.buffers == [1, 2]


def test_a_pool_of_no_slots_holds_nothing() -> None:
    pool = _pool(0)
    assert len(pool) == 0 and pool.buffers == [] and 0 not in pool
    with pytest.raises(RuntimeError, match="no free buffer for bucket 0"):
        pool.take(0)
    with pytest.raises(ValueError, match="count"):
        _pool(-1)
