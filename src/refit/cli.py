"""The `refit` command: demo, check, diagram."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def _check(args: argparse.Namespace) -> int:
    from refit.invariants import check_trace
    from refit.trace import load_trace, runs

    try:
        _header, events, torn = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        print(f"refit check: cannot read {args.trace}: {exc}", file=sys.stderr)
        return 2
    violations = check_trace(events, torn=torn)
    n_runs = len(runs(events))
    if args.json:
        print(json.dumps({"runs": n_runs, "events": len(events), "violations": [v.__dict__ for v in violations]}))
    elif violations:
        for v in violations:
            print(f"VIOLATION {v}")
            if v.seq is not None:
                event = next((e for e in events if e.get("seq") == v.seq), None)
                print(f"  event: {json.dumps(event)}")
        print(f"{len(violations)} violation(s) in {n_runs} run(s), {len(events)} events: {args.trace}")
    else:
        print(f"ok: {n_runs} run(s), {len(events)} events, every invariant holds: {args.trace}")
    return 1 if violations else 0


def _replay(args: argparse.Namespace) -> int:
    from refit.replay import replay

    try:
        report = replay(args.trace)
    except (OSError, ValueError, KeyError) as exc:
        print(f"refit replay: cannot replay {args.trace}: {exc}", file=sys.stderr)
        return 2
    print(
        f"replayed {report.runs} run(s), {report.events} events in {report.seconds:.3f}s (injected faults are not "
        f"replayed: their effects are, as recorded outcomes): {report.path}"
    )
    for i, (rec, rep) in enumerate(zip(report.recorded, report.replayed, strict=False)):
        same = "same" if rec == rep else "DIFFERENT"
        print(f"  run {i + 1}: recorded {rec.state}, replayed {rep.state} ({same})")
        if rec.failing_event:
            print(f"    first failing call: {rec.failing_event}")
    if report.divergence is not None:
        print(f"DIVERGED at {report.divergence}")
        return 1
    print("reproduced: same events, same final states, same failing calls")
    return 0


def _soak(args: argparse.Namespace) -> int:
    from refit.soak import soak

    report = soak(
        args.refits, engines=args.engines, mode=args.mode, bucket_bytes=args.bucket_bytes,
        fault_every=args.fault_every, verify_every=args.verify_every, in_thread=args.in_thread,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        r = report
        print(
            f"{r.refits} refits into {r.engines} engine {'threads' if args.in_thread else 'processes'} "
            f"({r.mode}, {r.buckets_per_refit} buckets each) in {r.seconds:.1f}s: {r.refits_per_second} refits/s"
        )
        print(
            f"  every engine updated: {r.ok}/{r.refits}; injected faults: {r.injected_faults}; "
            f"weight mismatches at checks: {r.mismatches}"
        )
        print(
            f"  growth while open: shm segments {r.segments_growth}, fds {r.fds_growth}, threads "
            f"{r.threads_growth} (call pool: {r.pool_threads} workers), RSS {r.rss_growth_mib:+.1f} MiB"
        )
        print(
            f"  left after close: shm segments {r.segments_left}, processes {r.processes_left}, "
            f"threads {r.threads_left}"
        )
        print(f"  leaks: {r.leaks}")
    return 1 if report.leaks or report.mismatches else 0


def _bench(args: argparse.Namespace) -> int:
    from refit import bench

    if args.what == "control":
        report = bench.control(engines=args.engines, refits=args.refits, mode=args.mode)
        print(
            f"control plane: {report['engines']} engine processes, {report['refits']} refits ({report['mode']}), "
            f"{report['buckets_per_refit']} bucket each"
        )
        print(f"  round trips per refit: {report['round_trips_per_refit']:g} (goal <= 2)")
        print(
            f"  stall minus transfer: median {report['control_ms_median']:.2f} ms, "
            f"p99 {report['control_ms_p99']:.2f} ms (goal: median <= 10 ms); "
            f"stall {report['stall_ms_median']:.2f} ms, transfer {report['transfer_ms_median']:.2f} ms"
        )
    else:
        report = bench.transport(
            refits=args.refits, bucket_mb=args.bucket_mb, checksums=not args.no_checksums, small=args.small
        )
        print(
            f"shm transport: {report['bytes'] / 1e9:.2f} GB in {report['buckets']} buckets of "
            f"{report['bucket_bytes'] >> 20} MiB into one engine process; memcpy {report['memcpy_gbps']:.2f} GB/s; "
            f"bit-exact {report['bit_exact']}"
        )
        for name, v in report["variants"].items():
            print(
                f"  {name:<24} checksums {'on ' if v['checksums'] else 'off'} {v['gbps']:6.2f} GB/s "
                f"({v['seconds'] * 1e3:6.1f} ms)  ratio {v['ratio']:.2f}"
            )
        print(f"  goal (zero_copy, checksums on): ratio >= 0.7; measured {report['ratio']:.2f}")
    bench.write_json(report, args.json)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _diagram(args: argparse.Namespace) -> int:
    from refit import diagram

    target = Path(args.out) / diagram.DIAGRAM_FILE
    if args.check:
        if diagram.is_current(args.out, args.readme):
            print(f"{target} is current")
            return 0
        print(f"{target} (or the README's copy) is stale: run `refit diagram`", file=sys.stderr)
        return 1
    for path in diagram.write(args.out, args.readme):
        print(f"wrote {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from refit.demo import run_demo
    from refit.protocol.faults import FaultPlan

    if args.fail_at:  # refused now, not after the engines started and the trainer trained
        try:
            FaultPlan.parse(args.fail_at, engines=args.engines)
        except ValueError as exc:
            print(f"refit demo: --fail-at: {exc}", file=sys.stderr)
            return 2
    return run_demo(args)


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=_count(1), default=2, help="reference engines to refit (default 2)")
    p.add_argument("--refits", type=_count(1), default=3, help="refits to run (default 3)")
    p.add_argument("--steps", type=_count(1), default=20, help="optimizer steps between refits (default 20)")
    p.add_argument("--mode", choices=("colocated", "disaggregated"), default="colocated")
    p.add_argument("--pause-mode", choices=("abort", "retract", "in_place"), default="retract")
    p.add_argument("--bucket-bytes", type=_count(1), default=64 << 10, help="bucket size in bytes (default 64 KiB)")
    p.add_argument("--deadline", type=_seconds, default=60.0, help="seconds each refit may take (default 60)")
    p.add_argument("--retries", type=_count(0), default=1, help="retries for an engine whose update failed (default 1)")
    p.add_argument("--call-timeout", type=_seconds, default=5.0, help="cap on one engine call in seconds (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", metavar="PATH", help="write the JSONL trace of every refit here")
    p.add_argument(
        "--fail-at",
        metavar="SPEC",
        help="inject one fault, e.g. transferring:engine=1:bucket=2:kind=kill "
        "(keys: engine, bucket, call, kind = raise | hang | kill | corrupt)",
    )
    p.add_argument("--in-thread", action="store_true", help="run engines on threads instead of processes")
    p.add_argument("--ranks", type=_count(1), default=1, help="trainer ranks; >1: FSDP2 on gloo processes (default 1)")
    p.add_argument(
        "--engine-tp", type=_count(1), default=1, help="TP processes per engine, each with a shard (default 1)"
    )
    p.add_argument("--transport", choices=("shm", "broadcast"), default="shm", help="shm or a broadcast group")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refit", description="Refit trainer weights into rollout engines, checked.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a real CPU refit into reference-engine processes")
    _demo_arguments(demo)
    demo.set_defaults(func=_demo)

    check = sub.add_parser("check", help="check a recorded trace against the refit invariants")
    check.add_argument("trace", help="a JSONL trace (refit demo --trace PATH writes one)")
    check.add_argument("--json", action="store_true", help="print a JSON summary")
    check.set_defaults(func=_check)

    rep = sub.add_parser("replay", help="re-run a recorded trace through the real runner, report divergence")
    rep.add_argument("trace", help="a JSONL trace (refit demo --trace PATH writes one)")
    rep.set_defaults(func=_replay)

    soak_p = sub.add_parser("soak", help="many consecutive refits, then count leaked segments, fds, threads, processes")
    soak_p.add_argument("--refits", type=_count(1), default=1000)
    soak_p.add_argument("--engines", type=_count(1), default=2)
    soak_p.add_argument("--mode", choices=("colocated", "disaggregated"), default="disaggregated")
    soak_p.add_argument("--bucket-bytes", type=_count(1), default=64 << 10)
    soak_p.add_argument(
        "--fault-every", type=int, default=10, help="inject a raise/corrupt fault every N refits (0: none)"
    )
    soak_p.add_argument("--verify-every", type=int, default=100, help="compare engine weights with the trainer every N")
    soak_p.add_argument("--in-thread", action="store_true", help="engines on threads instead of processes")
    soak_p.add_argument("--json", action="store_true")
    soak_p.set_defaults(func=_soak)

    bench_p = sub.add_parser("bench", help="measured figures against a floor: control plane, transport")
    bench_p.add_argument("what", choices=("control", "transport"))
    bench_p.add_argument("--engines", type=_count(1), default=8, help="control: engine processes (default 8)")
    bench_p.add_argument("--refits", type=_count(1), default=None, help="refits to measure (control 100, transport 6)")
    bench_p.add_argument("--mode", choices=("colocated", "disaggregated"), default="disaggregated")
    bench_p.add_argument("--bucket-mb", type=_count(1), default=64, help="transport: bucket size in MiB (default 64)")
    bench_p.add_argument("--no-checksums", action="store_true", help="transport: turn corruption detection off")
    bench_p.add_argument("--small", action="store_true", help="transport: a few-MB state (a quick smoke run)")
    bench_p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    bench_p.set_defaults(func=_bench)

    diag = sub.add_parser("diagram", help="regenerate docs/diagrams from the state table")
    diag.add_argument("--out", default="docs/diagrams", help="output directory (default docs/diagrams)")
    diag.add_argument("--readme", default="README.md", help="README whose diagram block to refresh (default README.md)")
    diag.add_argument("--check", action="store_true", help="exit 1 if the committed diagram is stale")
    diag.set_defaults(func=_diagram)

    args = parser.parse_args(argv)
    if getattr(args, "func", None) is _bench and args.refits is None:
        args.refits = 100 if args.what == "control" else 6
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
