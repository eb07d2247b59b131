"""The conformance kit for LoRA-capable engine drivers (`serves_adapters`): Hypothesis explores
sequences of LoRA refits, some with a fault in one of their states, with requests naming the
adapter in flight, and checks what the engines serve, not what the drivers claim.

    from refit.testing import check_lora_driver

    def test_my_driver_serves_adapters():
        check_lora_driver(lambda name: MyEngineDriver.start(name), max_examples=10)

The trainer is the tiny model (`TinyLlama`) wrapped by PEFT (rank 4 on every projection); each
refit takes a training step on the adapter only and runs `protocol.run` over a `LoraSource`.
After every refit:

  * every trace invariant over everything recorded (`refit.invariants.check_trace`, with the
    adapter moves the engines reported: `adapter_moves`, `adapter_live`);
  * served    an engine the run reports `updated` serves the new version: a request naming the
              adapter is tagged with it and its tokens are the ones the PEFT model gives with that
              version's adapter (teacher forcing: near-ties cannot flake); a quarantined one refuses;
              one held stale by the version policy is not asked (requests naming the adapter wait
              there until a refit reaches it: the last step is a refit with no fault); any other
              that answers serves a version it was published (the tag) with that version's tokens;
  * pinned    every request in flight across the refit finished (none aborted) and each token is
              what the version it is tagged with gives: a driver that moves a request to another
              version mid-way (an in-place reload) fails here;
  * live      an engine reports at most max_staleness + 1 versions of the adapter (`info()`);
  * progress  a refit with no fault updates every engine;
  * audit     where the driver has `audit()`, the engine's own adapter records and the requests it
              served pass `refit.invariants.adapters` (`adapter_served`: no token of an unloaded
              version).

What the kit needs from a driver besides the protocol calls: `generate(prompt, n, *, adapter,
timeout) -> {"output", "adapter_version"}`, `submit(prompt, n, *, adapter) -> Future`, optional
`info()["adapters"]`, `audit()`, `close()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.strategies as st
from hypothesis import Phase
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from refit import invariants, protocol
from refit.drivers.base import EngineDriver
from refit.testing.kit import kit_settings

ADAPTER = "policy"
PROMPTS = ([3, 1, 4, 1, 5], [9, 2, 6], [2, 7, 1, 8, 2, 8])
NEW_TOKENS = 6
# where a LoRA refit's engine calls run, and the faults the kit injects there
LORA_FAULTS: dict[str, tuple[str, ...]] = {
    "CONNECTING": ("probe",),
    "STAGING": ("stage",),
    "TRANSFERRING": ("load",),
    "POST_PROCESSING": ("finalize",),
    "VERIFYING": ("verify",),
    "DRAINING": ("drain",),
    "CONTINUING": ("publish",),
}
KINDS = ("raise", "corrupt", "hang")


class LoraDriverMachine(RuleBasedStateMachine):
    """One fleet of LoRA-capable engines and its refits (see the module docstring)."""

    factory: Callable[[str], EngineDriver]
    n_engines: int = 2

    @staticmethod
    def transport() -> Any:
        from refit.drivers.shm import SharedMemoryTransport

        return SharedMemoryTransport()

    def __init__(self) -> None:
        super().__init__()
        self.engines: list[Any] = []
        self.ctx: protocol.RefitContext | None = None
        self.snapshots: dict[int, dict[str, Any]] = {}  # version -> the adapter's tensors
        self.oracles: dict[int, Any] = {}
        self.published: dict[str, set[int]] = {}  # engine -> versions it was published
        self.inflight: list[tuple[str, list[int], Any]] = []
        self.step = 0

    staleness: Sequence[int | None] = (0, 1, 2, None)
    verify: str = "digest"

    @initialize(data=st.data())
    def setup(self, data: Any) -> None:
        max_staleness = data.draw(st.sampled_from(list(type(self).staleness)), label="max_staleness")
        import peft
        import torch

        from refit.drivers.lora_source import LoraSource
        from refit.reference.model import ModelConfig, TinyLlama

        torch.manual_seed(0)
        self.config = ModelConfig()
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        self.model = peft.get_peft_model(
            TinyLlama(self.config, seed=0),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
        ).eval()
        self.engines = [type(self).factory(f"lora{i}") for i in range(self.n_engines)]
        self.published = {e.name: set() for e in self.engines}
        self.max_staleness = max_staleness
        self.ctx = protocol.RefitContext(
            LoraSource(self.model, name=ADAPTER), type(self).transport(), self.engines, max_staleness=max_staleness,
            deadline_s=20, call_timeout_s=1.5, retries=1, verify=type(self).verify,
        )  # fmt: skip
        self._refit(None)  # version 1 everywhere, so requests can name the adapter

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            if self.ctx is not None:
                self.ctx.close()
        for e in self.engines:
            with contextlib.suppress(Exception):
                e.close()

    # ---- the oracle ------------------------------------------------------------------------------

    def _oracle(self, version: int) -> Any:
        """The PEFT model with `version`'s adapter (a copy of the trainer's, loaded from the snapshot)."""
        import copy

        import peft

        if version not in self.oracles:
            model = copy.deepcopy(self.model)
            peft.set_peft_model_state_dict(model, self.snapshots[version])
            self.oracles[version] = model.eval()
        return self.oracles[version]

    def _check_tokens(self, engine: str, prompt: list[int], out: dict[str, Any], why: str) -> None:
        import torch

        version, tokens = out.get("adapter_version"), list(out.get("output") or [])
        if version not in self.snapshots:
            raise AssertionError(f"served: engine {engine} tagged a request with adapter version {version!r} ({why})")
        if version not in self.published[engine]:
            raise AssertionError(f"served: engine {engine} served adapter version {version}, never published to it")
        if not tokens:
            raise AssertionError(f"served: engine {engine} gave no tokens ({why})")
        with torch.no_grad():
            logits = self._oracle(version)(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].float()
        for i, tok in enumerate(tokens):
            top = logits[i].topk(2)
            tie = float(top.values[0] - top.values[1]) < 1e-4
            if tok != int(top.indices[0]) and not (tie and tok == int(top.indices[1])):
                raise AssertionError(
                    f"{why}: engine {engine}: token {i} of a request tagged adapter version {version} is not what "
                    "that version gives (a request served by another version's adapter, or mixed ones)"
                )

    # ---- rules -----------------------------------------------------------------------------------

    def _refit(self, fault: tuple[str, str, str, int] | None) -> protocol.RefitResult:
        import peft
        import torch

        from refit.protocol.faults import FaultPlan

        assert self.ctx is not None
        self.step += 1
        gen = torch.Generator().manual_seed(self.step)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        target = self.ctx.published_version + 1
        self.snapshots[target] = {n: t.detach().clone() for n, t in peft.get_peft_model_state_dict(self.model).items()}
        self.ctx.faults = None
        if fault is not None:
            state, call, kind, engine = fault
            self.ctx.faults = FaultPlan().fail_at(state.lower(), engine=engine, call=call, kind=kind)
        result = protocol.run(self.ctx)
        self.ctx.faults = None
        if result.violations:
            raise AssertionError("; ".join(f"{v.invariant}: {v.message}" for v in result.violations))
        problems = invariants.check_trace(self.ctx.recorder.events, open_ok=True)
        if problems:
            raise AssertionError(f"{problems[0].invariant}: {problems[0].message}")
        for name, outcome in result.engines.items():
            if outcome.status == "updated":
                self.published[name].add(result.version)
        if fault is None and {o.status for o in result.engines.values()} != {"updated"}:
            raise AssertionError(f"progress: a LoRA refit with no fault did not update every engine: {result}")
        for e in self.engines:
            outcome = result.engines[e.name]
            if outcome.status == "stale":  # the version policy holds the adapter there: its requests wait
                continue
            try:
                out = e.generate(PROMPTS[0], NEW_TOKENS, adapter=ADAPTER, timeout=30)
            except Exception as exc:  # refused, or not answering: only where the run said it would not serve
                if outcome.status in ("stale", "quarantined", "failed"):
                    continue
                raise AssertionError(f"served: engine {e.name} ({outcome.status}) refused a request: {exc}") from exc
            if outcome.status == "quarantined":
                raise AssertionError(f"served: engine {e.name} was quarantined and still served a request")
            if outcome.status == "updated" and out.get("adapter_version") != result.version:
                raise AssertionError(
                    f"served: engine {e.name} reported updated to {result.version} and serves adapter version "
                    f"{out.get('adapter_version')}"
                )
            self._check_tokens(e.name, PROMPTS[0], out, f"served after refit {result.version} ({outcome.status})")
        return result

    @rule()
    def refit(self) -> None:
        self._settle_inflight()
        self._refit(None)

    @rule(
        state=st.sampled_from(sorted(LORA_FAULTS)), kind=st.sampled_from(KINDS), engine=st.integers(0, 1),
    )  # fmt: skip
    def refit_with_fault(self, state: str, kind: str, engine: int) -> None:
        if (state == "DRAINING" and self.max_staleness is None) or (state == "VERIFYING" and self.verify == "off"):
            state = "CONTINUING"  # (no version policy: no DRAINING; verify off: no VERIFYING)
        self._refit((state, LORA_FAULTS[state][0], kind, engine % self.n_engines))
        self._settle_inflight()

    @rule(n=st.integers(1, 4))
    def submit(self, n: int) -> None:
        for i in range(n):
            e = self.engines[i % self.n_engines]
            prompt = PROMPTS[i % len(PROMPTS)]
            self.inflight.append((e.name, prompt, e.submit(prompt, NEW_TOKENS * 3, adapter=ADAPTER)))

    def _settle_inflight(self) -> None:
        from refit.errors import EngineError

        for name, prompt, fut in self.inflight:
            try:
                out = fut.result(timeout=60)
            except EngineError as exc:
                if exc.kind == "quarantined":  # refused when submitted: its engine was out of service
                    continue
                raise
            if out.get("finish_reason") == "quarantined" and self.max_staleness is not None:
                continue  # its engine was held out of service by the version policy (it says so)
            if out.get("finish_reason") != "length":
                raise AssertionError(f"pinned: engine {name}: a request in flight ended {out.get('finish_reason')!r}")
            self._check_tokens(name, prompt, out, "pinned: a request in flight across LoRA refits")
        self.inflight.clear()

    @invariant()
    def live_versions(self) -> None:
        if not self.engines or self.max_staleness is None:
            return
        for e in self.engines:
            info = e.info(timeout=10) if hasattr(e, "info") else {}
            versions = (info.get("adapters") or {}).get(ADAPTER, {})
            servable = [v for v in versions.values() if v.get("state") in ("LIVE", "RETIRED")]
            if len(servable) > self.max_staleness + 1:
                raise AssertionError(
                    f"live: engine {e.name} serves {len(servable)} versions of the adapter (max_staleness "
                    f"{self.max_staleness})"
                )

    def check_audits(self) -> None:
        from refit.invariants.adapters import adapter_records, check_adapter_moves

        for e in self.engines:
            audit = e.audit(timeout=10) if hasattr(e, "audit") else None
            if audit:
                problems = check_adapter_moves(adapter_records(audit), engine=e.name)
                if problems:
                    raise AssertionError(f"{problems[0].invariant}: {problems[0].message}")


def check_lora_driver(
    factory: Callable[[str], EngineDriver],
    *,
    max_examples: int = 10,
    engines: int = 2,
    seed: int = 0,
    steps: int = 6,
    staleness: Sequence[int | None] = (0, 1, 2, None),
    transport: Callable[[], Any] | None = None,
    verify: str = "digest",
) -> None:
    """Run the LoRA kit against drivers made by `factory(name)` (each call a fresh engine).
    `staleness`: the max_staleness settings drawn (an engine may refuse some: SGLang needs >= 1);
    `transport`: makes the refits' transport (default shared memory); `verify`: the refits' verify
    mode (an engine that reports no adapter digests takes "off"). Raises AssertionError
    naming the check that failed."""

    class Machine(LoraDriverMachine):
        pass

    Machine.factory = staticmethod(factory)  # type: ignore[assignment]
    Machine.n_engines = engines
    Machine.staleness = tuple(staleness)
    Machine.verify = verify
    if transport is not None:
        Machine.transport = staticmethod(transport)  # type: ignore[assignment]

    def teardown(self: LoraDriverMachine) -> None:
        try:
            if self.ctx is not None:
                self._refit(None)  # a refit with no fault reaches every engine: held requests go on
            self._settle_inflight()
            self.check_audits()
        finally:
            LoraDriverMachine.teardown(self)

    Machine.teardown = teardown  # type: ignore[method-assign]
    run_state_machine_as_test(Machine, settings=kit_settings(max_examples, steps, (Phase.explicit, Phase.generate)))


__all__: Sequence[str] = ("LoraDriverMachine", "check_lora_driver")
