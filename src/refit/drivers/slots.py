"""A transport's reusable buffers (its `slots`) and which bucket occupies each: `SlotPool`.

A bucket takes the lowest free slot to be packed into and holds it until every engine acked it
(`release`). When an engine may still read a slot's buffer (`abandon`), that buffer is never
written again: the pool's factory makes a fresh one in its place and the old one lives on for as
long as its reader holds it. One pool per connection, written once for every transport; the
buffer type is the transport's own (a tensor; a file and its mapping; a tensor and its handle).
Oversized buckets, which get a buffer of their own, are not the pool's business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

B = TypeVar("B")

FULL = "{owner}: no free buffer for bucket {bucket}; buckets {held} wait for acks"
MISSING = "{owner}: no buffer holds bucket {bucket} (slots hold {held})"


class SlotPool(Generic[B]):
    """`count` slots, each a buffer made by `new` (at once, or on the slot's first `take` when
    `lazy`) and the bucket that occupies it, if any. `owner` names the transport in its errors;
    `full` and `missing` are the messages (formatted with `owner`, `bucket` and `held`, what the
    slots hold) when no slot is free for a bucket and when no slot holds the bucket asked for."""

    def __init__(
        self,
        count: int,
        new: Callable[[], B],
        *,
        owner: str,
        lazy: bool = False,
        full: str = FULL,
        missing: str = MISSING,
    ) -> None:
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"a slot pool has an integer count >= 0 of slots, got {count!r}")
        self._new = new
        self._owner = owner
        self._full = full
        self._missing = missing
        self._buffers: list[B | None] = [None if lazy else new() for _ in range(count)]
        self._held: list[int | None] = [None] * count

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, bucket: object) -> bool:
        return bucket is not None and bucket in self._held

    @property
    def held(self) -> list[int | None]:
        """The bucket each slot holds (None: free), in slot order."""
        return list(self._held)

    @property
    def buffers(self) -> list[B]:
        """The buffers made so far, in slot order (a lazy pool's untaken slots have none)."""
        return [b for b in self._buffers if b is not None]

    def take(self, bucket: int) -> B:
        """The lowest free slot's buffer, now held by `bucket` (made first if it has none yet)."""
        try:
            slot = self._held.index(None)
        except ValueError:
            raise RuntimeError(self._message(self._full, bucket)) from None
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = self._buffers[slot] = self._new()
        self._held[slot] = bucket
        return buffer

    def slot_of(self, bucket: int) -> int:
        """The slot `bucket` occupies; RuntimeError (`missing`) if it holds none."""
        try:
            return self._held.index(bucket)
        except ValueError:
            raise RuntimeError(self._message(self._missing, bucket)) from None

    def buffer_of(self, bucket: int) -> B:
        """The buffer `bucket` occupies; RuntimeError (`missing`) if it holds none."""
        buffer = self._buffers[self.slot_of(bucket)]
        assert buffer is not None  # a taken slot always has its buffer
        return buffer

    def release(self, bucket: int) -> None:
        """Every reader is done with `bucket`: its slot's buffer may be written again."""
        self._held[self.slot_of(bucket)] = None

    def abandon(self, bucket: int) -> B:
        """A reader may still hold `bucket`'s buffer: the slot gets a fresh buffer (returned) and
        is free; the old buffer is never handed out again."""
        slot = self.slot_of(bucket)
        buffer = self._buffers[slot] = self._new()
        self._held[slot] = None
        return buffer

    def _message(self, template: str, bucket: int) -> str:
        return template.format(owner=self._owner, bucket=bucket, held=self._held)
