"""`pdserve profile`: flags and entry point; the measurement (torch) is imported only here."""

from __future__ import annotations

import argparse
import os
import sys


def add_profile_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.config import EngineConfig

    parser = subparsers.add_parser(
        "profile", help="measure this machine's step times and write a hardware profile"
    )
    parser.add_argument("--model", default=EngineConfig.model)
    cores = len(os.sched_getaffinity(0))
    parser.add_argument(
        "--threads",
        default=",".join(str(t) for t in sorted({1, cores})),
        help="comma-separated thread counts to profile (one cost model each)",
    )
    parser.add_argument("--kv-cache-bytes", type=int, help="per worker (default: engine's)")
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", required=True, help="profile JSON to write")
    parser.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.perf.measure import ProfileConfig, build_profile

    try:
        threads = tuple(int(t) for t in args.threads.split(","))
        cfg = ProfileConfig(args.model, threads, args.kv_cache_bytes, args.decode_steps,
                            args.repeats)  # fmt: skip
        profile = build_profile(cfg, log=lambda line: print(line, file=sys.stderr))
    except ValueError as exc:
        print(f"pdserve profile: error: {exc}", file=sys.stderr)
        return 2
    profile.save(args.output)
    print(f"wrote {args.output}: {profile.device}, {profile.model.name}, threads {threads}")
    return 0
