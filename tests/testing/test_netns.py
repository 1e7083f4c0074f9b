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
            stdout=subprocess.PIPE,
            text=True,
        )
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


COUNT_DATAGRAMS = (
    "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "s.bind((sys.argv[1], 7001)); print('up', flush=True); s.settimeout(3); n = 0\n"
    "try:\n    while s.recv(64) != b'end': n += 1\nexcept TimeoutError: pass\nprint(n)"
)
SEND_DATAGRAMS = (
    "import socket, sys, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "for _ in range(1000): s.sendto(b'x', (sys.argv[1], 7001)); time.sleep(0.0002)\n"
    "for _ in range(50): s.sendto(b'end', (sys.argv[1], 7001)); time.sleep(0.01)"
)


def datagrams_through(hosts: Hosts) -> int:
    """Of 1,000 datagrams from a to b, how many b received (the 'end' marker is sent 50 times
    so a lossy link still ends the count)."""
    counter = subprocess.Popen(
        [*hosts.prefix_of("b"), sys.executable, "-c", COUNT_DATAGRAMS, hosts.ip("b")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert counter.stdout.readline().strip() == "up"
    assert on(hosts, "a", SEND_DATAGRAMS, hosts.ip("b")).returncode == 0
    return int(counter.communicate(timeout=10)[0])


def test_a_lossy_link_drops_about_its_share_each_way_and_can_be_cleared():
    with Hosts(["a", "b"], prefix="pdtl") as hosts:
        assert datagrams_through(hosts) == 1000
        hosts.shape("b", Link(loss_pct=30.0))  # b's input drops 30%: 700 expected
        assert hosts.loss_by in ("netem", "nftables")
        assert 600 < datagrams_through(hosts) < 800
        hosts.shape("a", Link(loss_pct=30.0))  # and a's output: 0.7 * 0.7 = 490 expected
        assert 390 < datagrams_through(hosts) < 590
        hosts.shape("a", Link())
        hosts.shape("b", Link(rate="100mbit"))
        assert datagrams_through(hosts) == 1000


SINK = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 7002)); print('up', flush=True)\n"
    "for _ in range(2):\n    c, _ = s.accept()\n    while c.recv(1 << 16): pass\n"
    "    c.sendall(b'k'); c.close()"
)
PUSH = (
    "import socket, sys, time; t = time.perf_counter()\n"
    "c = socket.create_connection((sys.argv[1], 7002), timeout=20)\n"
    "c.sendall(bytes(int(sys.argv[2]))); c.shutdown(socket.SHUT_WR); c.recv(1)\n"
    "print(time.perf_counter() - t)"
)


def test_set_rate_cuts_a_links_bandwidth_tenfold_mid_run():
    """256 KiB at 40 Mbit/s takes ~52 ms; after set_rate to 4 Mbit/s, ~520 ms."""
    with Hosts(["a", "b"], prefix="pdtr") as hosts:
        hosts.shape("b", Link(rate="40mbit"))
        sink = subprocess.Popen(
            [*hosts.prefix_of("b"), sys.executable, "-c", SINK, hosts.ip("b")],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sink.stdout.readline().strip() == "up"
        fast_s = float(on(hosts, "a", PUSH, hosts.ip("b"), str(256 << 10)).stdout)
        hosts.set_rate("b", "4mbit")
        slow_s = float(on(hosts, "a", PUSH, hosts.ip("b"), str(256 << 10)).stdout)
        assert sink.wait(10) == 0
        assert 0.4 < slow_s < 1.5 and slow_s > 5 * fast_s, (fast_s, slow_s)


def test_link_qdisc_puts_loss_in_netem_only_where_the_kernel_has_it():
    lossy = Link(rate="1gbit", loss_pct=1.0)
    assert lossy.qdisc(netem=True) == [
        "netem",
        "delay",
        "0.0ms",
        "loss",
        "random",
        "1.0%",
        "rate",
        "1gbit",
    ]
    assert lossy.qdisc(netem=False)[0] == "tbf"
    assert Link().qdisc() == ["pfifo"]


def test_one_set_of_hosts_at_a_time_the_next_waits_for_it():
    """Every Hosts uses the same subnet, and a second one's clean-up would delete a live
    run's namespaces: the second waits (here, past its timeout) until the first leaves."""
    with Hosts(["a"], prefix="pdtk"):
        with pytest.raises(TimeoutError, match="another run"):
            Hosts(["b"], prefix="pdtj", lock_timeout_s=0.3).__enter__()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "pdtk-a" in names and "pdtj" not in names
    with Hosts(["b"], prefix="pdtj", lock_timeout_s=0.3) as hosts:
        assert hosts.ip("b") == "10.77.0.2"
