"""`pdserve profile`: flags and entry point; the measurement (torch) is imported only here."""

from __future__ import annotations

import argparse
import sys

from pdserve.perf.measure import ProfileConfig
from pdserve.schema import add_flags, flag_values, from_flat


def add_profile_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile", help="measure this machine's step times and write a hardware profile"
    )
    add_flags(parser, ProfileConfig)
    parser.add_argument("--output", required=True, help="profile JSON to write")
    parser.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.perf.measure import build_profile

    cfg = from_flat(ProfileConfig, flag_values(args, ProfileConfig))
    profile = build_profile(cfg, log=lambda line: print(line, file=sys.stderr))
    profile.save(args.output)
    print(f"wrote {args.output}: {profile.device}, {profile.model.name}, threads {cfg.threads}")
    return 0
