"""The production vLLM driver through the conformance kit (`refit.testing`), against emulated vLLM
servers over real HTTP (its own file: the kit is one of the longest tests, and CI spreads files
over workers)."""

from __future__ import annotations

from refit.drivers.vllm_transport import VLLMIPCTransport
from refit.testing import check_engine_driver
from refit.testing.vllm_server import EmulatedVLLMEngine


def test_vllm_driver_passes_the_conformance_kit() -> None:
    """The production vLLM driver against emulated vLLM servers (IPC, packed): every fault kind in
    every state, then the Hypothesis state machine; what each engine serves is checked."""
    coverage = check_engine_driver(
        lambda name: EmulatedVLLMEngine.start(name, backend="ipc", in_thread=True),  # real HTTP; engine on a thread
        transport=VLLMIPCTransport, max_examples=4, steps=5,
        # a step is one to three HTTP round trips; 1 s leaves a loaded 2-core box the slack
        call_timeout_s=1.0,
    )  # fmt: skip
    assert coverage.checks["weights read back"] > 50 and coverage.checks["quarantined refused"] > 10
    assert {"hang", "kill", "raise", "corrupt"} <= set(coverage.kinds)
