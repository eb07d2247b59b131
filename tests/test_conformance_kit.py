"""The conformance kit passes the reference driver and fails each deliberately broken driver with a
message naming the invariant it breaks. Each broken driver reproduces a real refit bug."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from refit.drivers.base import Payload
from refit.drivers.reference import ReferenceEngine
from refit.errors import EngineError
from refit.protocol.lock import LocalLock
from refit.testing import check_engine_driver


def test_the_reference_driver_conforms() -> None:
    check_engine_driver(ReferenceEngine.in_thread, max_examples=30)


def test_the_reference_driver_conforms_over_the_broadcast_transport() -> None:
    """The same kit with the collective transport: a group per connection, rebuilt when a member fails."""
    from refit.drivers.broadcast import BroadcastTransport

    check_engine_driver(ReferenceEngine.in_thread, max_examples=15, transport=BroadcastTransport)


class ForgetsToFlush(ReferenceEngine):
    """Reports the KV flush done without doing it (NeMo RL#4018, miles#2782: stale prefix KV)."""

    def flush(self, *, timeout: float) -> None:
        return None


class FinalizesTwice(ReferenceEngine):
    """Calls the engine's finalize twice and swallows the second error (end_weight_update both in
    the happy path and in a finally block)."""

    def finalize(self, *, timeout: float) -> None:
        self.client.call("finalize", timeout=timeout)
        with contextlib.suppress(EngineError):
            self.client.call("finalize", timeout=timeout)


class VersionBeforeFinalize(ReferenceEngine):
    """Labels the new version before the weights are finalized (slime/NeMo RL bump the version at
    the start of the update; SGLang's /update_weight_version checks nothing)."""

    def finalize(self, *, timeout: float) -> None:
        version = self.client.call("info", timeout=timeout)["version"]
        self.client.call("label_version", version + 1, timeout=timeout)
        self.client.call("finalize", timeout=timeout)


class _SloppyLock(LocalLock):
    def release(self, owner: str) -> bool:  # releases for anyone who asks (slime's Lock actor)
        with self._mutex:
            self._holder = None
            return True


_SLOPPY = _SloppyLock()


class ReleasesOthersLock(ReferenceEngine):
    """Hosts the engines' lock but lets any token release it (a late release from an old owner
    then unlocks another refit's lease)."""

    def engine_lock(self) -> Any:
        return _SLOPPY


class ContinuesAfterPartialTransfer(ReferenceEngine):
    """When a bucket fails, resumes generation itself "so rollouts are not stuck" (NeMo RL #3612
    resumed on every path): the engine serves half-updated weights."""

    def load(self, payload: Payload, *, timeout: float) -> None:
        try:
            self.client.call("load", payload, timeout=timeout)
        except Exception:
            self.client.call("continue_generation", timeout=timeout)
            raise


class AcksBeforeCopy(ReferenceEngine):
    """Returns from load as soon as the request is sent, before the engine copied the bucket out
    (slime#929: the producer buffer was reused before the engine finished reading it)."""

    def load(self, payload: Payload, *, timeout: float) -> None:
        self.client.call_async("load", payload)


BROKEN = {
    "kv_fresh": ForgetsToFlush,
    "finalize_once": FinalizesTwice,
    "version": VersionBeforeFinalize,
    "lock": ReleasesOthersLock,
    "pause_continue": ContinuesAfterPartialTransfer,
    "paired": AcksBeforeCopy,
}


@pytest.mark.parametrize(("invariant", "driver"), BROKEN.items(), ids=[d.__name__ for d in BROKEN.values()])
def test_the_kit_fails_a_broken_driver_naming_the_invariant(invariant: str, driver: type[ReferenceEngine]) -> None:
    with pytest.raises(AssertionError) as info:
        check_engine_driver(driver.in_thread, max_examples=30, shrink=False)
    message = str(info.value)
    assert f"{invariant}:" in message, message
