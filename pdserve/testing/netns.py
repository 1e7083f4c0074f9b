"""Hosts on one machine: network namespaces on a private bridge, each with its own address,
its own /dev/shm and a shaped link, so prefill and decode workers can run as on separate
hosts (no shared memory, a link of a given rate, delay and loss, a link that goes down).

    root namespace: bridge <prefix>br, 10.77.0.1/24 (the router runs here)
      ├── veth <prefix>h0 ══ eth0 in namespace <prefix>-<name0>, 10.77.0.2/24
      ├── veth <prefix>h1 ══ eth0 in namespace <prefix>-<name1>, 10.77.0.3/24
      ...

A host's link is shaped on both ends (the namespace's eth0 and the bridge side), so
`delay_ms` is one way and a round trip takes twice it; `rate` caps each direction (a token
bucket, or netem's rate with a delay); `loss_pct` drops packets at random each way, with netem
where the kernel has it, else with nftables at each end's ingress (some kernels have no
sch_netem: delay and jitter then raise, loss still works). Only addresses of the namespaces
made here are ever used. `Hosts` is a context manager: leaving it, normally or by an
exception, kills what still runs in the namespaces and deletes them, the bridge and the loss
tables; a crashed run's leftovers under the same prefix are removed on entry. One `Hosts` at
a time per machine (a file lock): a second waits for the first to leave.

Needs root and iproute2 (`ip`, `tc`); `available()` says whether they are there.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO

SUBNET = "10.77.0"  # a private /24 that exists only on the bridge made here
LOCK_DIR = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
LOCK_PATH = os.path.join(LOCK_DIR, "pdserve-netns.lock")
# Inside `ip netns exec` (which already gives the command a mount namespace of its own, with
# mounts not propagated back), a fresh tmpfs on /dev/shm: the host's segments are not seen.
_PRIVATE_SHM = 'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'


def available() -> str:
    """Why namespace hosts cannot be made here, or "" when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs iproute2 ({', '.join(missing)} not found)" if missing else ""


@dataclass(frozen=True)
class Link:
    """A host's link, each direction: `rate` as tc writes it ("1gbit", "100mbit"; None:
    unshaped), one-way `delay_ms` and `jitter_ms` (tc netem, which some kernels lack: then a
    RuntimeError says so), `loss_pct` of packets dropped at random (netem, else nftables)."""

    rate: str | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def qdisc(self, netem: bool = True) -> list[str]:
        """The root qdisc's tc arguments: netem when there is a delay (or a loss, with
        `netem`), else a token bucket whose burst is 1 ms of the rate (at least 16 KiB), else
        a plain FIFO. Without `netem` the loss is left out, for nftables to apply."""
        if self.delay_ms or self.jitter_ms or (netem and self.loss_pct):
            args = ["netem", "delay", f"{self.delay_ms}ms"]
            if self.jitter_ms:
                args.append(f"{self.jitter_ms}ms")
            if netem and self.loss_pct:
                args += ["loss", "random", f"{self.loss_pct}%"]
            return args + (["rate", self.rate] if self.rate else [])
        if self.rate:
            burst_bytes = max(16 << 10, bits_per_s(self.rate) // 8 // 1000)
            return ["tbf", "rate", self.rate, "burst", str(burst_bytes), "latency", "100ms"]
        return ["pfifo"]


def bits_per_s(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: a number with kbit, mbit or gbit")


def _hold_machine_lock(timeout_s: float) -> IO[bytes]:
    """One `Hosts` at a time on a machine: every one uses the same subnet (10.77.0.0/24 on its
    bridge), and its clean-up on entry would delete the namespaces of a live run under the
    same prefix (the test suite beside a benchmark). The lock is a file's flock, released by
    the kernel when its holder exits, so a crashed run never blocks the next."""
    lock = open(LOCK_PATH, "wb")  # held until __exit__
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                raise TimeoutError(
                    f"namespace hosts: another run held {LOCK_PATH} for {timeout_s:.0f} s"
                ) from None
            time.sleep(0.2)


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """`with Hosts(["prefill", "decode"]) as hosts:` then `hosts.ip("decode")`,
    `hosts.prefix_of("decode")` (a command prefix that runs inside), `hosts.shape(...)`,
    `hosts.set_rate(name, "100mbit")` (mid-run), `hosts.set_link(name, up=False)`,
    `hosts.remove(name)`. `loss_by` says what drops the packets of a lossy link: "netem" or
    "nftables" ("" until a loss is set)."""

    def __init__(
        self,
        names: list[str],
        prefix: str = "pds",
        shm_bytes: int = 1 << 30,
        lock_timeout_s: float = 900.0,
    ) -> None:
        """`lock_timeout_s`: how long to wait for another run's hosts to go (one at a time
        per machine), then TimeoutError."""
        if len(names) > 200 or len(set(names)) != len(names):
            raise ValueError("host names must be distinct, at most 200")
        if len(prefix) > 8 or not prefix.isalnum():
            raise ValueError("prefix: at most 8 letters or digits (interface names are short)")
        self.names, self.prefix, self.shm_bytes = list(names), prefix, shm_bytes
        self.lock_timeout_s = lock_timeout_s
        self.bridge = f"{prefix}br"
        self.gateway = f"{SUBNET}.1"  # the root namespace's address on the bridge
        self._index = {name: i for i, name in enumerate(names)}
        self._live: set[str] = set()
        self._links: dict[str, Link] = {}
        self._netem: bool | None = None  # whether the kernel has sch_netem, once tried
        self.loss_by = ""

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def ip(self, name: str) -> str:
        return f"{SUBNET}.{self._index[name] + 2}"

    def _veth(self, name: str) -> str:
        return f"{self.prefix}h{self._index[name]}"

    def prefix_of(self, name: str) -> list[str]:
        """Prepend to a command to run it on host `name` (its network, its own /dev/shm)."""
        shm = _PRIVATE_SHM.format(size=self.shm_bytes)
        return ["ip", "netns", "exec", self.namespace(name), "sh", "-c", shm, "sh"]

    def __enter__(self) -> Hosts:
        self._lock = _hold_machine_lock(self.lock_timeout_s)
        try:
            self.cleanup()  # a crashed run's leftovers under this prefix
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for name in self.names:
                self._add(name)
        except BaseException:
            self.cleanup()
            self._lock.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.cleanup()
        finally:
            self._lock.close()

    def _add(self, name: str) -> None:
        ns, veth, peer = self.namespace(name), self._veth(name), f"{self._veth(name)}p"
        _run("ip", "netns", "add", ns)
        self._live.add(name)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "link", "set", peer, "netns", ns)
        inside = ("ip", "netns", "exec", ns, "ip")
        _run(*inside, "link", "set", peer, "name", "eth0")
        _run(*inside, "addr", "add", f"{self.ip(name)}/24", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up")
        _run(*inside, "link", "set", "lo", "up")

    def shape(self, name: str, link: Link) -> None:
        """Shape both directions of `name`'s link (replacing what was there). A loss goes to
        netem; when the kernel has no netem (learnt on the first try), to nftables."""
        if self._netem is not False and link.loss_pct and not (link.delay_ms or link.jitter_ms):
            try:
                self._qdisc(name, link.qdisc(netem=True))
                self._netem = True
            except RuntimeError as e:
                if "unknown" not in str(e):
                    raise
                self._netem = False
        netem = bool(self._netem)
        self._qdisc(name, link.qdisc(netem=netem))
        self._set_loss(name, 0.0 if netem else link.loss_pct)
        self._links[name] = link
        if link.loss_pct:
            self.loss_by = "netem" if netem else "nftables"

    def set_rate(self, name: str, rate: str | None) -> None:
        """Change the rate of `name`'s link in place, both ways, keeping its delay and loss
        (a tbf or netem change: what is queued stays queued), as a link whose capacity
        drops or recovers mid-run."""
        link = self._links.get(name, Link())
        link = Link(rate, link.delay_ms, link.jitter_ms, link.loss_pct)
        self._qdisc(name, link.qdisc(netem=bool(self._netem)))
        self._links[name] = link

    def _qdisc(self, name: str, args: list[str]) -> None:
        inside = ("ip", "netns", "exec", self.namespace(name))
        for where, dev in (((), self._veth(name)), (inside, "eth0")):
            done = _run(*where, "tc", "qdisc", "replace", "dev", dev, "root", *args, check=False)
            if done.returncode:
                raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")

    def _loss_table(self, name: str) -> str:
        return f"pdloss_{self._veth(name)}"

    def _set_loss(self, name: str, loss_pct: float) -> None:
        """Random loss at the ingress of each end (nftables netdev hooks): into the host at
        its eth0, out of it at the bridge side's veth. Dropped on arrival, as on a wire: the
        sender is never told (an output hook would fail its send with EPERM)."""
        inside = ("ip", "netns", "exec", self.namespace(name))
        table = self._loss_table(name)
        for where in ((), inside):
            _run(*where, "nft", "delete", "table", "netdev", table, check=False)
        if not loss_pct:
            return
        if shutil.which("nft") is None:
            raise RuntimeError("loss needs nftables (apt-get install nftables)")
        drop = f"numgen random mod 10000 < {round(loss_pct * 100)} drop"
        for where, dev in (((), self._veth(name)), (inside, "eth0")):
            ruleset = (
                f"table netdev {table} {{ chain ingress {{\n"
                f'type filter hook ingress device "{dev}" priority 0; {drop}\n}}\n}}\n'
            )
            done = subprocess.run(
                [*where, "nft", "-f", "-"],
                input=ruleset,
                text=True,
                capture_output=True,
                timeout=30,
            )
            if done.returncode:
                raise RuntimeError(f"nft: {done.stderr.strip()}")

    def set_link(self, name: str, up: bool) -> None:
        """Cut (`up=False`) or restore `name`'s link at the bridge: packets in flight are lost
        and connections stall as on a pulled cable, nothing is reset."""
        _run("ip", "link", "set", self._veth(name), "up" if up else "down")

    def pids(self, name: str) -> list[int]:
        out = _run("ip", "netns", "pids", self.namespace(name), check=False).stdout
        return [int(p) for p in out.split()]

    def remove(self, name: str) -> None:
        """The host disappears as a machine that loses power: its link is cut first, so no
        reset reaches its peers, then everything running on it is killed (SIGKILL) and its
        namespace and link deleted."""
        _run("ip", "link", "set", self._veth(name), "down", check=False)
        for _ in range(50):
            pids = self.pids(name)
            if not pids:
                break
            signal_all(pids, signal.SIGKILL)
            time.sleep(0.1)
        _run("ip", "link", "del", self._veth(name), check=False)
        _run("ip", "netns", "del", self.namespace(name), check=False)
        if shutil.which("nft") is not None:
            _run("nft", "delete", "table", "netdev", self._loss_table(name), check=False)
        self._live.discard(name)

    def cleanup(self) -> None:
        """Remove every namespace of this prefix (processes in them killed) and the bridge."""
        listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
        ours = {line.split()[0] for line in listed if line.startswith(f"{self.prefix}-")}
        for name in self.names:
            if self.namespace(name) in ours or name in self._live:
                self.remove(name)
        for ns in ours - {self.namespace(n) for n in self.names}:
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        if shutil.which("nft") is not None:
            tables = _run("nft", "list", "tables", "netdev", check=False).stdout.split()
            for table in tables:
                if table.startswith(f"pdloss_{self.prefix}h"):
                    _run("nft", "delete", "table", "netdev", table, check=False)
