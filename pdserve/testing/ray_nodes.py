"""A Ray cluster across namespace hosts (`pdserve.testing.netns.Hosts`): the head on the
bridge's gateway address in the root namespace, one worker node inside each named host, with
its own address, its own /dev/shm and a custom resource naming it (`host_<name>: 1`), so a
role's `ray_resources` puts its actors on that host.

    with Hosts(["prefill", "decode"]) as hosts, RayNodes(hosts) as nodes:
        pdserve up --ray <nodes.address> ...   # prefill: {"host_prefill": 1}, and so on

Every node is a `ray start --block` in a process session of its own, with a temp dir made
here. Leaving stops them: SIGTERM, then SIGKILL after a grace, to every process of those
sessions and to every process whose command line names the temp dir (Ray's workers and the
raylet's helpers), so only this cluster's processes are touched. `ray stop` is not used: it
finds Ray's processes by name across the machine, whatever namespace or cluster they serve.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from pdserve.testing import netns
from pdserve.testing.netns import Hosts, Link

STARTED = "Ray runtime started"  # what `ray start` prints once its node is up
STOP_GRACE_S = 5.0


def available() -> str:
    """Why a Ray cluster across namespace hosts cannot start here, or "" when it can."""
    why = netns.available()
    if not why and not _ray_bin().exists():
        why = f"needs Ray's `ray` beside {sys.executable} (pip install 'pdserve[ray]')"
    return why


def _ray_bin() -> Path:
    """The `ray` script of the Python running this (a virtualenv's, even when not on PATH)."""
    return Path(sys.executable).with_name("ray")


def _head_port(ip: str) -> int:
    """A free port for the head's GCS below the kernel's ephemeral range (32768 up) and above
    Ray's worker ports (10002-19999). A port found free in the ephemeral range can go, before
    the GCS binds it, to any socket the kernel numbers (Ray's own servers of another cluster
    among them), and a node that dials it reaches that instead; below the range only an
    explicit bind takes it."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port for a Ray head on {ip} in 20000-32767")


class RayNodes:
    """`RayNodes(hosts, names=None, num_cpus=1)`: a head on `hosts.gateway` (resources
    `head_resources`, `num_cpus`) and a worker node in each of `names` (all of `hosts` by
    default). `address` is the head's GCS address (`host:port`, for `ray.init` and
    `pdserve up --ray`); `resource(name)` the resource naming a host's node."""

    def __init__(
        self,
        hosts: Hosts,
        names: list[str] | None = None,
        num_cpus: int = 1,
        head_resources: dict[str, float] | None = None,
        object_store_bytes: int = 128 << 20,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.hosts, self.names = hosts, list(hosts.names if names is None else names)
        self.num_cpus, self.object_store_bytes = num_cpus, object_store_bytes
        self.head_resources = dict(head_resources or {})
        self.start_timeout_s = start_timeout_s
        self.address = ""
        self.temp_dir = ""
        self._procs: list[tuple[subprocess.Popen, IO[bytes]]] = []

    @staticmethod
    def resource(name: str) -> str:
        return f"host_{name}"

    def __enter__(self) -> RayNodes:
        self.temp_dir = tempfile.mkdtemp(prefix="pdsray-")
        try:
            gateway = self.hosts.gateway
            port = _head_port(gateway)
            self.address = f"{gateway}:{port}"
            head = [
                "--head",
                f"--node-ip-address={gateway}",
                f"--port={port}",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false",
            ]
            self._start([], "head", head, self.head_resources)
            for name in self.names:
                args = [f"--address={self.address}", f"--node-ip-address={self.hosts.ip(name)}"]
                self._start(self._inside(name), name, args, {self.resource(name): 1})
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _inside(self, name: str) -> list[str]:
        """The prefix that runs a command on host `name` with the temp dir its own: a folder
        of it bound over it in the host's mount namespace. Ray's nodes on separate machines
        never share it; sharing it, each node's log monitor would also forward the others'
        workers' logs, under its own address."""
        own = os.path.join(self.temp_dir, "nodes", name)
        os.makedirs(own)
        bind = 'mount --bind "$0" "$1" && shift && exec "$@"'
        return [*self.hosts.prefix_of(name), "sh", "-c", bind, own, self.temp_dir]

    def _start(
        self, prefix: list[str], name: str, args: list[str], resources: dict[str, float]
    ) -> None:
        """One node, up (its `ray start` said so) within `start_timeout_s`."""
        log = open(os.path.join(self.temp_dir, f"start-{name}.log"), "w+b")
        # One authentication mode for every node: unset, `ray start --head` turns token
        # authentication on where ~/.ray/auth_token exists (a new local ray.init() writes it)
        # and `ray start --address` does not, so the head refuses its nodes. Hosts on a
        # private bridge need no token.
        command = [
            *prefix,
            "env",
            "RAY_AUTH_MODE=disabled",
            str(_ray_bin()),
            "start",
            "--block",
            "--disable-usage-stats",
            f"--num-cpus={self.num_cpus}",
            f"--resources={json.dumps(resources)}",
            f"--object-store-memory={self.object_store_bytes}",
            *args,
        ]
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._procs.append((proc, log))
        deadline = time.monotonic() + self.start_timeout_s
        while STARTED.encode() not in Path(log.name).read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text(errors="replace")[-2000:]
                why = f"exited {proc.returncode}" if proc.poll() is not None else "timed out"
                raise RuntimeError(f"ray node {name!r} did not start ({why}):\n{tail}")
            time.sleep(0.2)

    def pids(self) -> set[int]:
        """This cluster's live processes: those of its nodes' sessions and those whose
        command line names its temp dir."""
        sessions = {proc.pid for proc, _ in self._procs}
        marker = self.temp_dir.encode()
        found = set()
        for entry in Path("/proc").glob("[0-9]*"):
            pid = int(entry.name)
            try:
                cmdline = (entry / "cmdline").read_bytes()
                in_session = os.getsid(pid) in sessions
            except OSError:  # gone meanwhile
                continue
            if pid != os.getpid() and (in_session or (marker and marker in cmdline)):
                found.add(pid)
        return found

    def stop(self) -> None:
        """SIGTERM to every process of this cluster, SIGKILL to what remains after a grace;
        the temp dir removed."""
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            netns.signal_all(self.pids(), sig)
            deadline = time.monotonic() + wait_s
            while self.pids() and time.monotonic() < deadline:
                for proc, _ in self._procs:
                    proc.poll()  # reaps our direct children
                time.sleep(0.1)
        for proc, log in self._procs:
            proc.poll()
            log.close()
        self._procs = []
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """`sudo python -m pdserve.testing.ray_nodes prefill decode --rate 1gbit`: the hosts and
    their Ray nodes, up until Ctrl-C or SIGTERM, then all stopped and removed."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.testing.ray_nodes")
    parser.add_argument("names", nargs="+", help="one namespace host and Ray node per name")
    parser.add_argument("--rate", help="each host's link, each way (tc: 1gbit, 100mbit)")
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs each node offers")
    args = parser.parse_args(argv)
    if why := available():
        parser.error(why)
    for sig in (signal.SIGTERM, signal.SIGINT):  # leave through the clean-up
        signal.signal(sig, lambda *_: sys.exit(0))
    with Hosts(args.names) as hosts, RayNodes(hosts, num_cpus=args.num_cpus) as nodes:
        for name in hosts.names:
            if args.rate:
                hosts.shape(name, Link(rate=args.rate))
            print(f"host {name}: {hosts.ip(name)}, Ray resource {nodes.resource(name)}")
        print(f"Ray head: {nodes.address} (pdserve up --ray {nodes.address}); Ctrl-C stops")
        sys.stdout.flush()
        signal.pause()


if __name__ == "__main__":
    main()
