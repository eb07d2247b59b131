"""The conformance kit passes the reference driver over the collective broadcast transport (its
own file: one of the longest tests, and CI spreads files over workers)."""

from __future__ import annotations

from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.testing import check_engine_driver

from .conftest import SUMMARY


def test_the_reference_driver_conforms_over_the_broadcast_transport() -> None:
    """The same kit with the collective transport: a group per connection, rebuilt when a member
    fails. Atomic runs over it are drawn, not swept (test_conformance_kit.py sweeps them over shared
    memory; tests/test_atomic.py runs atomic over both broadcast modes)."""
    coverage = check_engine_driver(
        ReferenceEngine.in_thread, max_examples=10, transport=BroadcastTransport, sweep_atomic=False
    )
    SUMMARY.append(f"conformance kit (reference driver, broadcast): {coverage.summary()}")
