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
    parser.add_argument(
        "--rescale",
        metavar="PROFILE",
        help="instead of the grid (half an hour on a slow "
        "CPU), re-time a short probe per thread count of PROFILE, measured on this machine, "
        "and write it at this machine's speed now (its model, threads and KV size kept)",
    )
    parser.add_argument(
        "--update",
        metavar="PROFILE",
        help="measure --threads and the served figures again "
        "and keep PROFILE's other thread counts (its model and KV size too): a thread count "
        "measured while something else ran, without the whole grid again",
    )
    parser.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    if args.rescale:
        return _rescale(args.rescale, args.output)
    from pdserve.costmodel.profile import load_profile
    from pdserve.perf.measure import build_profile

    cfg = from_flat(ProfileConfig, flag_values(args, ProfileConfig))
    base = load_profile(args.update) if args.update else None
    profile = build_profile(cfg, log=lambda line: print(line, file=sys.stderr), base=base)
    profile.save(args.output)
    threads = tuple(sorted(profile.models))
    print(f"wrote {args.output}: {profile.device}, {profile.model.name}, threads {threads}")
    return 0


def _rescale(path: str, output: str) -> int:
    from pdserve.costmodel.profile import load_profile
    from pdserve.perf.rescale import probe_ratios, rescaled

    profile = load_profile(path)
    ratios = probe_ratios(profile, log=lambda line: print(line, file=sys.stderr))
    rescaled(profile, ratios).save(output)
    speeds = ", ".join(f"threads {k}: x{v:.3f}" for k, v in ratios.items())
    print(f"wrote {output}: {path} rescaled by a speed probe ({speeds})")
    return 0
