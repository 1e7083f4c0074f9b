"""Namespace hosts (pdserve/testing/netns.py): each its own address and /dev/shm, reachable
over the bridge, a link that can be cut, a host that can vanish, nothing left after."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.testing.netns import Hosts, Link, available

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "available")

SERVE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 7000)); "
    "print('up', flush=True); c, _ = s.accept(); c.sendall(b'hi'); c.close()"
)
DIAL = (
    "import socket, sys; c = socket.create_connection((sys.argv[1], 7000), timeout=2); "
    "print(c.recv(2).decode())"
)


def on(hosts: Hosts, name: str, code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    cmd = [*hosts.prefix_of(name), sys.executable, "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw)


def test_hosts_reach_each_other_share_no_memory_and_leave_nothing():
    with Hosts(["a", "b"], prefix="pdtn") as hosts:
        server = subprocess.Popen(
            [*hosts.prefix_of("b"), sys.executable, "-c", SERVE, hosts.ip("b")],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert server.stdout.readline().strip() == "up"
        hosts.shape("b", Link(rate="10mbit", loss_pct=1.0))
        assert on(hosts, "a", DIAL, hosts.ip("b")).stdout.strip() == "hi"
        assert server.wait(10) == 0
        listing = "import os; print(len(os.listdir('/dev/shm')))"
        assert on(hosts, "a", listing).stdout.strip() == "0"  # its own, empty /dev/shm
        hosts.set_link("b", up=False)
        assert on(hosts, "a", DIAL, hosts.ip("b")).returncode != 0  # cut: connect times out
        hosts.set_link("b", up=True)
        sleeper = subprocess.Popen([*hosts.prefix_of("b"), "sleep", "60"])
        deadline = time.monotonic() + 10
        while sleeper.pid not in hosts.pids("b"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        hosts.remove("b")  # the host vanishes with what ran on it
        assert sleeper.wait(10) == -9
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert "pdtn" not in names and "pdtn" not in links
