"""What refit ships for testing: the conformance kit for engine drivers (`check_engine_driver`,
in `refit.testing.kit`; it needs Hypothesis, a dev extra, and is imported only when asked for),
and the emulated SGLang and vLLM servers (`refit.testing.sglang_server`, `vllm_server`), which
`refit demo --engine sglang|vllm` uses and which need no dev extra.

    from refit.testing import check_engine_driver

    def test_my_driver_conforms():
        report = check_engine_driver(lambda name: MyEngineDriver.start(name), max_examples=25)
        print(report.summary())
"""

from __future__ import annotations

from typing import Any

__all__ = ["Coverage", "DriverStateMachine", "check_engine_driver", "check_lora_driver", "sweep"]


def __getattr__(name: str) -> Any:
    if name == "check_lora_driver":  # LoRA-capable drivers (`serves_adapters`): refit.testing.lora_kit
        from refit.testing import lora_kit

        return lora_kit.check_lora_driver
    if name in __all__:
        from refit.testing import kit

        return getattr(kit, name)
    raise AttributeError(f"module 'refit.testing' has no attribute {name!r}")
