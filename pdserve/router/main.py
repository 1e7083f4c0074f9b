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
import os
import signal
import sys

import zmq

from pdserve.router.config import RouterConfig
from pdserve.router.server import serve

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
API_KEY_ENV = "PDSERVE_API_KEY"  # preferred over the JSON's api_key: env never shows in `ps`


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router.main")
    parser.add_argument("--config-json", required=True, help="RouterConfig fields as JSON")
    args = parser.parse_args(argv)
    secret_hex = os.environ.get(SECRET_ENV, "")
    if not secret_hex:
        raise ValueError(f"{SECRET_ENV} must hold the cluster secret as hex")
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        raise ValueError(f"{SECRET_ENV} is not valid hex") from None
    try:
        data = json.loads(args.config_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config-json is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--config-json must be a JSON object")
    if os.environ.get(API_KEY_ENV):
        data["api_key"] = os.environ[API_KEY_ENV]
    return RouterConfig.from_dict(data, secret=secret)


async def _serve_until_signalled(config: RouterConfig) -> None:
    """SIGTERM/SIGINT cancel the server so its cleanup (sockets, open responses) runs."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await serve(config)
    except asyncio.CancelledError:
        pass


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
        asyncio.run(_serve_until_signalled(config))
    except (OSError, zmq.ZMQError) as exc:  # e.g. the port or control address is taken
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
