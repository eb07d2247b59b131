"""The production SGLang driver through the conformance kit (`refit.testing`), against emulated
SGLang servers over real HTTP (its own file: the kit is the longest test, and CI spreads files
over workers)."""

from __future__ import annotations

from refit.drivers.sglang_transport import SGLangTensorTransport
from refit.testing import check_engine_driver
from refit.testing.sglang_server import EmulatedSGLangEngine


def test_sglang_driver_passes_the_conformance_kit() -> None:
    """The production SGLang driver, against emulated SGLang servers: every fault kind in every
    state (hangs and kills really happen in the server), then the Hypothesis state machine; what
    each engine serves is checked, not what the driver says. SGLang's update carries no checksum,
    so a corrupted bucket is simulated at the driver boundary."""
    coverage = check_engine_driver(
        lambda name: EmulatedSGLangEngine.start(name, in_thread=True),  # real HTTP; the engine on a thread
        transport=SGLangTensorTransport, max_examples=4, steps=5,
        # a step is one to four HTTP round trips (the last bucket's carries finalize and the
        # verification by SGLang's checksums); 1.5 s leaves a loaded 2-core box, where the
        # emulated servers and the trainer's digests share this process's GIL, the slack a real
        # server needs too (SGLang's abort pause polls every second while a request holds its lock)
        call_timeout_s=1.5,
    )  # fmt: skip
    assert coverage.checks["weights read back"] > 50 and coverage.checks["quarantined refused"] > 10
    assert {"hang", "kill", "raise", "corrupt"} <= set(coverage.kinds)
