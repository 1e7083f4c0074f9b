import socket

from pdserve.cluster import launcher
from pdserve.cluster.launcher import LISTEN_PORTS_LOW, free_port


def test_a_listener_port_comes_from_below_the_ephemeral_range():
    # bind(0) hands out ports of the ephemeral range, which outgoing connections take too:
    # a port picked there can be gone by the time its process binds it
    low = launcher._ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert LISTEN_PORTS_LOW <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: the process it goes to can bind it


def test_a_port_taken_is_not_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(launcher, "LISTEN_PORTS_LOW", taken)  # the only candidate
        monkeypatch.setattr(launcher, "_ephemeral_low", lambda: taken + 1)
        assert free_port() != taken  # the kernel's pick instead


def test_with_no_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(launcher, "_ephemeral_low", lambda: LISTEN_PORTS_LOW)
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_one_process_never_hands_out_a_port_twice():
    # a cluster picks its router and control ports before any is bound: two picks of one
    # port (random, 600 of ~12,800 here: a repeat all but certain) would fail the second bind
    picks = [free_port() for _ in range(600)]
    assert len(set(picks)) == len(picks)
