"""Deterministic, keyed fault injection: make a chosen driver call fail, to prove cleanup works.

`FaultPlan().fail_at("transferring", engine=1, bucket=2, kind="kill")` fires at the first driver
call that matches (state, engine index, bucket, call); keys left as None match anything; each fault
fires once and is recorded in the trace. Kinds:

  raise    the call raises InjectedFault instead of running
  hang     the call does not return inside its time budget (the engine stalls, then carries on late)
  kill     the engine's process dies (SIGKILL) when the call reaches it
  corrupt  the call's payload arrives damaged: a bucket's bytes fail their checksum, any other
           request cannot be decoded

hang, kill and corrupt happen inside the engine when its driver supports `arm_fault` (the
reference engine does); otherwise the runner simulates them at the driver boundary. On trainer-
side calls (source, transport) hang stalls the call until the deadline and the others raise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAULT_KINDS = ("raise", "hang", "kill", "corrupt")


class InjectedFault(RuntimeError):
    """The error an injected `raise` fault produces."""


@dataclass
class Fault:
    state: str
    engine: int | None = None
    bucket: int | None = None
    call: str | None = None
    kind: str = "raise"
    fired: int = 0

    def matches(self, state: str, call: str, engine: int | None, bucket: int | None) -> bool:
        return (
            self.fired == 0
            and self.state == state
            and (self.engine is None or self.engine == engine)
            and (self.bucket is None or self.bucket == bucket)
            and (self.call is None or self.call == call)
        )

    def describe(self) -> dict[str, object]:
        return {
            "state": self.state,
            "engine": self.engine,
            "bucket": self.bucket,
            "call": self.call,
            "kind": self.kind,
        }


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)

    def fail_at(
        self,
        state: str,
        *,
        engine: int | None = None,
        bucket: int | None = None,
        call: str | None = None,
        kind: str = "raise",
    ) -> FaultPlan:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r}; known {FAULT_KINDS}")
        state = state.upper()
        key = (state, engine, bucket, call)
        if any((f.state, f.engine, f.bucket, f.call) == key for f in self.faults):
            raise ValueError(f"a fault is already planned at {key}")
        self.faults.append(Fault(state, engine, bucket, call, kind))
        return self

    def take(self, state: str, call: str, engine: int | None, bucket: int | None) -> Fault | None:
        """The fault to fire for this call, marking it fired; None if no fault matches."""
        for fault in self.faults:
            if fault.matches(state, call, engine, bucket):
                fault.fired += 1
                return fault
        return None

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """'transferring:engine=1:bucket=2[:call=load][:kind=kill]' -> a plan with that one fault."""
        state, *parts = spec.split(":")
        kwargs: dict[str, object] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or key not in ("engine", "bucket", "call", "kind"):
                raise ValueError(f"bad fault spec part {part!r} in {spec!r} (use engine=, bucket=, call=, kind=)")
            kwargs[key] = int(value) if key in ("engine", "bucket") else value
        return cls().fail_at(state, **kwargs)  # type: ignore[arg-type]
