"""The LoRA conformance kit (`refit.testing.check_lora_driver`): the reference driver passes, in
threads and in processes, and an engine that reloads an adapter in place (requests in flight move
to the new version mid-way, as vLLM's `load_inplace` does) fails it, named."""

from __future__ import annotations

from typing import Any

import pytest

from refit.drivers.reference import ReferenceEngine
from refit.reference.client import start_thread
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig
from refit.testing import check_lora_driver


def test_the_reference_driver_passes_the_lora_kit_in_threads() -> None:
    check_lora_driver(lambda name: ReferenceEngine.in_thread(name, max_running=4), max_examples=8)


@pytest.mark.e2e
def test_the_reference_driver_passes_the_lora_kit_in_processes() -> None:
    check_lora_driver(lambda name: ReferenceEngine.spawn(name, max_running=4), max_examples=3)


class ReloadsInPlace(EngineCore):
    """Publishing a version moves every request pinned to an older one onto it (an in-place reload:
    one adapter slot per name, rewritten)."""

    def publish(self, version: int) -> Any:
        out = super().publish(version)
        live = self.lora.live("policy")
        for req in self.running:
            if req.adapter is not None and live is not None and req.adapter is not live:
                req.adapter.pinned -= 1
                req.adapter, live.pinned = live, live.pinned + 1
        self.lora.collect()
        return out


def test_the_lora_kit_fails_an_engine_that_reloads_in_place() -> None:
    def factory(name: str) -> ReferenceEngine:
        return ReferenceEngine(start_thread(name, ModelConfig(), 0, core=ReloadsInPlace, max_running=4))

    with pytest.raises(AssertionError, match="pinned: a request in flight across LoRA refits"):
        check_lora_driver(factory, max_examples=20)
