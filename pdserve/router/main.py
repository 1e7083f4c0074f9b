"""Router process entry, spawned by the launcher:

    PDSERVE_CLUSTER_SECRET=<hex> python -m pdserve.router.main --config-json '<RouterConfig JSON>'

The secret comes from the environment, never the command line, so it does not show in `ps`.
A bad config exits non-zero with one line naming the problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import zmq

from pdserve import envs
from pdserve.router.config import RouterConfig
from pdserve.router.server import serve
from pdserve.schema import from_dict


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router.main")
    parser.add_argument("--config-json", required=True, help="RouterConfig fields as JSON")
    args = parser.parse_args(argv)
    secret = envs.cluster_secret()
    try:
        data = json.loads(args.config_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config-json is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--config-json must be a JSON object")
    # Keys from the environment win over the JSON's: the environment never shows in `ps`.
    keys = {k: v for k, v in (("api_key", envs.api_key()), ("admin_key", envs.admin_key())) if v}
    return from_dict(RouterConfig, {**data, **keys, "secret": secret}, "router config")


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except (ValueError, TypeError) as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s router %(name)s: %(message)s",
    )
    try:
        asyncio.run(serve(config))
    except (OSError, zmq.ZMQError) as exc:  # e.g. the port or control address is taken
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
